"""A lost trainer rank (issue 37, detection): one event, `TrainerRankLost`, naming the rank, its
node and the cause; found among the ranks' failures whichever order they come in (the lost
rank's own death, or the others' collectives failing first); a collective's timeout told from
other errors; `train.collective_timeout_s` refused where it is nonsense. No Ray runs here:
Ray's exceptions are made as Ray makes them, and the calls are coroutines that raise them (the
same on a local Ray with a killed rank: tests/faults/test_trainer_rank_loss.py)."""

import asyncio
import math
from types import SimpleNamespace

import pytest

from eddyrl.errors import ConfigError, EddyError, WorkerCallError
from eddyrl.runtime_protocol import ACTOR_DIED, COLLECTIVE_TIMED_OUT, TrainerRankLost

# Ray 2.60's text for a trainer rank's process killed during a call
DIED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: TrainerRank\n"
        "\tactor_id: c1686d\n\tpid: 13906\n\tname: trainer-1\n\tnamespace: eddy-1\n"
        "\tip: 10.0.0.7\nThe actor is dead because its worker process has died. Worker exit "
        "type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection "
        "error code 2. End of file. Some common causes include: (1) the process was killed by "
        "the OOM killer due to high memory usage")
REASON = ("The actor is dead because its worker process has died. Worker exit type: "
          "SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error "
          "code 2. End of file.")
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                "waiting 10000ms for recv operation to complete")
GLOO_CLOSED = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
               "peer [127.0.0.1]:41234")
NCCL_TIMEOUT = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
                "OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=10000) ran for 10012 "
                "milliseconds before timing out.")


def test_the_event_names_rank_node_and_cause():
    lost = TrainerRankLost(1, "train_step", ACTOR_DIED, REASON, node="10.0.0.7",
                           node_id="5f1c0a2b9d3e4f5a6b7c8d9e", pid=13906)
    assert str(lost) == ("trainer rank 1 (node 10.0.0.7, node id 5f1c0a2b9d3e, pid 13906) was "
                         f"lost during train_step: actor died ({REASON}); the run cannot go on "
                         "without it")
    assert isinstance(lost, WorkerCallError)  # `eddy train` ends with it in one line
    assert (lost.rank, lost.node, lost.pid, lost.cause) == (1, "10.0.0.7", 13906, ACTOR_DIED)
    unknown = TrainerRankLost(0, "weight export", COLLECTIVE_TIMED_OUT)
    assert str(unknown) == ("trainer rank 0 (node unknown) was lost during weight export: "
                            "collective timed out; the run cannot go on without it")


def test_eddy_train_ends_on_it_with_how_to_resume(tmp_path):
    from eddyrl import cli_train

    config = SimpleNamespace(run_dir=str(tmp_path), checkpoint=SimpleNamespace(every=0))
    lost = TrainerRankLost(1, "train_step", ACTOR_DIED, REASON, node="127.0.0.1")
    with pytest.raises(EddyError) as line:
        cli_train._raise_as_one_line(lost, config)
    assert str(line.value).startswith(f"{lost}; no checkpoint was written yet"), line.value


def test_rays_reason_and_fields_of_a_dead_actor():
    from eddyrl.runtime.ray.errors import death_fields, death_reason

    assert death_reason(DIED) == REASON  # without Ray's advice
    assert death_fields(DIED) == {"pid": "13906", "ip": "10.0.0.7"}
    assert death_reason("something else\nentirely") == "something else"
    assert death_fields("no fields") == {}


def test_only_a_dead_process_is_a_death():
    from eddyrl.runtime.ray.errors import is_actor_death

    class ActorUnavailableError(Exception):  # Ray's: unreachable for now, maybe not dead
        actor_init_failed = False

    started_badly = ActorDiedError()
    started_badly.actor_init_failed = True  # its __init__ raised: a start-up error
    assert is_actor_death(ActorDiedError())
    assert not is_actor_death(started_badly)
    assert not is_actor_death(ActorUnavailableError())
    assert not is_actor_death(RuntimeError(DIED)) and not is_actor_death(None)


@pytest.mark.parametrize("text, timed_out", [(GLOO_TIMEOUT, True), (NCCL_TIMEOUT, True),
                                             (GLOO_CLOSED, False), ("CUDA out of memory", False)])
def test_a_collective_timeout_is_told_from_other_errors(text, timed_out):
    from eddyrl.hal import distributed

    assert distributed.timed_out(RuntimeError(text)) is timed_out
    try:  # found in what it was raised from, too
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        assert distributed.timed_out(outer) is timed_out
    assert not distributed.timed_out(ValueError("timed out"))  # not a backend's error
    assert not distributed.timed_out(None)


# ---- the lost rank among the ranks' failures ------------------------------------------------
class ActorDiedError(Exception):
    """Ray's, as the runtime reads it (duck-typed: runtime/ray/errors.py): a dead actor."""

    actor_init_failed = False

    def __init__(self) -> None:
        super().__init__(DIED)
        self.error_msg = DIED


class RayTaskError(Exception):
    """Ray's, for an exception raised in the actor's method: the exception is its `cause`."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::TrainerRank.train() (pid=100)\n{type(cause).__name__}: {cause}")
        self.cause = cause


class Calls:
    """`RayCalls` as the trainer's calls see it: a failure becomes WorkerCallError, raised
    from Ray's error."""

    async def call(self, who, what, ref):
        try:
            return await ref
        except Exception as exc:
            raise WorkerCallError(f"{who} failed during {what}: {exc}") from exc

    def raise_if_ray_lost(self, exc=None) -> None:
        pass


def _died():
    return ActorDiedError()


def _task_error(exc: BaseException):
    return RayTaskError(exc)


def _ranks(grace_s: float = 60.0):
    from eddyrl.runtime.ray.trainer_calls import RankPlace, TrainerCalls

    places = [RankPlace(node="127.0.0.1", node_id="aaaa", pid=100),
              RankPlace(node="127.0.0.1", node_id="bbbb", pid=101)]
    return TrainerCalls(Calls(), places, collective_timeout_s=10.0, grace_s=grace_s)


def _run(ranks, *coroutines):
    return asyncio.run(ranks.call_all([(r, "train_step", c) for r, c in enumerate(coroutines)]))


def test_the_dead_rank_is_named_though_the_other_failed_first():
    """Rank 0's collective fails first (its peer's connection closed), rank 1's death comes
    after: rank 1 is the lost one."""
    async def scenario():
        survivor_failed = asyncio.Event()

        async def rank_0():
            survivor_failed.set()
            raise _task_error(RuntimeError(GLOO_CLOSED))

        async def rank_1():
            await survivor_failed.wait()
            raise _died()

        return await _ranks().call_all([(0, "train_step", rank_0()),
                                        (1, "train_step", rank_1())])

    with pytest.raises(TrainerRankLost) as raised:
        asyncio.run(scenario())
    lost = raised.value
    assert (lost.rank, lost.cause, lost.detail) == (1, ACTOR_DIED, REASON)
    assert (lost.node, lost.node_id, lost.pid) == ("127.0.0.1", "bbbb", 101)  # as it said


def test_a_death_first_is_reported_at_once():
    async def hangs():
        await asyncio.Event().wait()

    async def dies():
        raise _died()

    with pytest.raises(TrainerRankLost) as raised:  # no grace waited: rank 0 never ends
        _run(_ranks(grace_s=math.inf), hangs(), dies())
    assert raised.value.rank == 1 and raised.value.cause == ACTOR_DIED


def test_a_rank_that_takes_no_part_is_named_by_the_others_timeout():
    async def times_out():
        raise _task_error(RuntimeError(GLOO_TIMEOUT))

    async def stopped():  # alive, its call never ends
        await asyncio.Event().wait()

    with pytest.raises(TrainerRankLost) as raised:
        _run(_ranks(grace_s=0.01), times_out(), stopped())
    lost = raised.value
    assert (lost.rank, lost.cause) == (1, COLLECTIVE_TIMED_OUT)
    assert lost.detail == ("trainer rank 0 waited train.collective_timeout_s = 10 s for it in "
                           "a collective; it is alive but took no part")


def test_the_rank_left_when_the_other_timeouts_are_in_is_the_lost_one():
    """Three ranks: rank 0 times out first, rank 2 a moment later; rank 1, still running,
    took no part (not rank 2, which was still waiting when rank 0 gave up)."""
    async def scenario():
        first_out = asyncio.Event()

        async def rank_0():
            first_out.set()
            raise _task_error(RuntimeError(GLOO_TIMEOUT))

        async def rank_1():
            await asyncio.Event().wait()

        async def rank_2():
            await first_out.wait()
            raise _task_error(RuntimeError(GLOO_TIMEOUT))

        ranks = _ranks(grace_s=1.0)  # rank 2's timeout comes in the loop's next turns
        ranks.places.append(ranks.places[0])
        return await ranks.call_all([(0, "weight export", rank_0()),
                                     (1, "weight export", rank_1()),
                                     (2, "weight export", rank_2())])

    with pytest.raises(TrainerRankLost) as raised:
        asyncio.run(scenario())
    assert (raised.value.rank, raised.value.during) == (1, "weight export")
    assert raised.value.detail.startswith("trainer ranks 0, 2 waited "), raised.value.detail


def test_an_error_of_the_step_itself_is_no_loss():
    async def fails():
        raise _task_error(ValueError("a bad batch"))

    async def finishes():
        return {"loss": 1.0}

    with pytest.raises(WorkerCallError) as raised:
        _run(_ranks(), fails(), finishes())
    assert not isinstance(raised.value, TrainerRankLost)
    assert str(raised.value).startswith("trainer rank 0 failed during train_step: "), raised.value


def test_results_in_rank_order_when_none_fails():
    async def result(value):
        return value

    assert _run(_ranks(), result("a"), result("b")) == ["a", "b"]


# ---- train.collective_timeout_s -------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, 5, 9.99])
def test_collective_timeout_refuses_nonsense(value):
    from eddyrl.config import load_config

    with pytest.raises(ConfigError, match=r"'train\.collective_timeout_s' = .* out of range; "
                                          r"allowed: \[10\.0, inf\)"):
        load_config(overrides=[f"train.collective_timeout_s={value}"])


def test_collective_timeout_refuses_nan():
    from eddyrl.config import load_config

    with pytest.raises(ConfigError, match=r"train\.collective_timeout_s"):
        load_config(overrides=["train.collective_timeout_s=nan"])


def test_collective_timeout_default_and_a_short_one_load():
    from eddyrl.config import load_config

    assert load_config().train.collective_timeout_s == 300.0
    assert load_config(overrides=["train.collective_timeout_s=10"]
                       ).train.collective_timeout_s == 10.0
