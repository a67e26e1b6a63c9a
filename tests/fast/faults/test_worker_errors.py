"""A failure inside a worker names its cause first (issue 19): it read `<role> failed during
<call>: ray::...() (pid=...)` with the real reason (a full disk, a missing module) only at the
end of a traceback. And a replacement rollout worker that cannot start (vLLM not installed) is
reported with that reason, once: it read "3 replacement processes in a row died".

The texts below are Ray 2.60's, as `str()` of the exceptions it raised in these cases; no Ray
runs here (the same on a local Ray, with actors that raise: test_worker_errors_on_ray.py)."""

from eddyrl.errors import ConfigError


def cause_line(exc):  # imported here, so that each test fails on its own where it is missing
    from eddyrl.runtime.ray.errors import cause_line

    return cause_line(exc)


def exception_lines(text):
    from eddyrl.runtime.ray.errors import exception_lines

    return exception_lines(text)

HEADER = ("\x1b[36mray::TrainerRank.save()\x1b[39m (pid=13906, ip=127.0.0.1, actor_id=c1686d, "
          "repr=<eddyrl.runtime.trainer_rank.TrainerRank object at 0x7f10cba839d0>)")
DISK_FULL = (f"{HEADER}\nOSError: [Errno 28] No space left on device: '/runs/x/model.safetensors'"
             "\n\nThe above exception was the direct cause of the following exception:\n\n"
             f"{HEADER}\n           ^^^^^^^^^^^^^^^^\n  File \"/eddyrl/runtime/trainer_rank.py\", line "
             "14, in save\n    raise RuntimeError(\"saving failed\") from e\n"
             "RuntimeError: saving failed")
NO_MODULE = ("The actor died because of an error raised in its creation task, \x1b[36mray::"
             "RolloutWorker.__init__()\x1b[39m (pid=13905, ip=127.0.0.1, actor_id=d84bc6)\n"
             "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n  File \"/eddyrl/engines/vllm.py\","
             " line 9, in __init__\n    import vllm\n            ^^^^^^^^^^^\n"
             "ModuleNotFoundError: No module named 'vllm'")
DIED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: RolloutWorker\n"
        "\tactor_id: c1686d\n\tpid: 13906\n\tip: 127.0.0.1\nThe actor is dead because its "
        "worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
        "unexpectedly exits with a connection error code 2. End of file. Some common causes "
        "include: (1) the process was killed by the OOM killer due to high memory usage")


class TaskError(Exception):  # what the driver sees of an exception raised in an actor's method
    def __init__(self, text, cause):
        super().__init__(text)
        self.cause = cause


class ActorDied(Exception):  # ... and of an actor that is gone, or whose __init__ raised
    def __init__(self, text, actor_init_failed):
        super().__init__(text)
        self.error_msg, self.actor_init_failed = text, actor_init_failed


def test_the_exception_lines_of_a_chain_innermost_first():
    assert exception_lines(DISK_FULL) == [
        "OSError: [Errno 28] No space left on device: '/runs/x/model.safetensors'",
        "RuntimeError: saving failed"]
    assert exception_lines(NO_MODULE) == ["ModuleNotFoundError: No module named 'vllm'"]


def test_a_task_error_starts_with_its_root_cause():
    line = cause_line(TaskError(DISK_FULL, RuntimeError("saving failed")))
    assert line == ("OSError: [Errno 28] No space left on device: '/runs/x/model.safetensors' "
                    "(leading to RuntimeError: saving failed)")


def test_an_eddy_error_raised_in_a_worker_is_its_message():
    error = ConfigError("model.path '/m' has no *.safetensors")
    text = f"{HEADER}\n  File \"x.py\", line 1\neddyrl.errors.ConfigError: {error}"
    assert cause_line(TaskError(text, error)) == str(error)
    died = ActorDied(text.replace(HEADER, "The actor died because of an error raised in its "
                                  "creation task, " + HEADER), True)
    assert cause_line(died) == f"{error} (raised as the actor started)"


def test_an_actor_whose_init_raised_names_the_error():
    assert cause_line(ActorDied(NO_MODULE, True)) == \
        "ModuleNotFoundError: No module named 'vllm' (raised as the actor started)"


def test_a_dead_process_says_why_without_rays_advice():
    line = cause_line(ActorDied(DIED, False))
    assert line.startswith("The actor died unexpectedly before finishing this task. The actor "
                           "is dead because its worker process has died.")
    assert "connection error code 2" in line and "OOM killer" not in line and "\n" not in line
