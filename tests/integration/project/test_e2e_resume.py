"""`eddy train` stopped and resumed on a local Ray with the tiny model: 2 steps with a checkpoint
after each, then `resume=auto` to 3. The resumed trainer holds exactly the saved weights and
optimizer state, the groups still in flight at the end of the first run are generated again,
and the ledger shows every prompt group trained once as fresh across the restart. Then a
rollback to step 2 moves the branch it abandons aside (named, not deleted), and a resume with
fewer steps than the checkpoint is refused before anything starts."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tree import SUPPORT_DIR as TESTS  # noqa: E402 (on the runs' PYTHONPATH)
RUN = ["loop.batch_prompts=4", "loop.eval_every=0", "rollout.n_samples=4",
       "rollout.max_new_tokens=16", "data.train_size=32", "data.eval_size=4",
       "cluster.threads_per_worker=1", "data.reward_fn=reward_fixtures:length_reward",
       "algorithm.dynamic_sampling=false", "window.max_staleness=1", "checkpoint.every=1"]


def _safetensors(directory):
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


@pytest.mark.slow
def test_train_then_resume_auto_continues_exactly(tiny_model_dir, tmp_path):
    """The default job (one process: `cluster.runtime` auto is local) trained, resumed and
    rolled back; on Ray, `test_a_killed_trainer_goes_on_from_its_last_checkpoint`."""
    from eddyrl.config import load_config
    from eddyrl.errors import ConfigError
    from eddyrl.launch import train

    def run(*overrides):
        config = load_config(overrides=[f"model.path={tiny_model_dir}", f"run_dir={tmp_path}",
                                        "platform=cpu", *RUN, *overrides])
        return json.loads(train(config).read_text())

    first = run("loop.steps=2")
    # A tiny learning rate leaves the weights exactly as loaded (Adam's step is ~1e-30): the
    # model after step 3 is then the model the resumed trainer started from.
    second = run("loop.steps=3", "resume=auto", "train.lr=1e-30")
    _check_second_run(tmp_path, tiny_model_dir, first, second)
    # A rollback to step 2: the branch it abandons (step 3 and the final model) is moved
    # aside, named, never deleted; resume=auto then follows the new branch.
    third = run("loop.steps=3", f"resume={tmp_path / 'checkpoints' / 'step_000002'}")
    (retired,) = (tmp_path / "checkpoints" / "retired").iterdir()
    assert third["resumed_from"].endswith("step_000002")
    assert sorted(p.name for p in retired.iterdir()) == ["checkpoint", "metrics.jsonl",
                                                          "samples.jsonl", "step_000003"]
    assert [json.loads(line)["step"] for line in (retired / "metrics.jsonl").open()] == [3]
    assert {json.loads(line)["step"] for line in (retired / "samples.jsonl").open()} == {3}
    old, new = (_safetensors(d) for d in (retired / "step_000003",
                                          tmp_path / "checkpoints" / "step_000003"))
    assert any(not torch.equal(old[name], new[name]) for name in old)  # the new branch
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="'loop.steps' = 2 is below the step"):
        run("loop.steps=2", "resume=auto")  # refused before anything starts
    assert second["runtime"] == "local"


def _check_second_run(tmp_path, tiny_model_dir, first, second):
    from eddyrl.core.ledger import Ledger, State

    checkpoints = tmp_path / "checkpoints"
    step2, step3 = checkpoints / "step_000002", checkpoints / "step_000003"
    assert first["steps"] == 2 and first["resumed_from"] is None
    assert second["steps"] == 3 and second["resumed_from"] == str(step2)
    assert second["requeued_groups"] == 4  # K = 1: the next batch was in flight at the end
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000003"]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3] and lines[-1]["mismatch_abs_max"] < 1e-4

    saved, after = _safetensors(step2), _safetensors(step3)
    initial = _safetensors(tiny_model_dir)
    assert all(torch.equal(after[name], saved[name]) for name in saved)
    assert any(not torch.equal(saved[name], initial[name]) for name in saved)  # it had trained
    optimizer = _safetensors(step3 / "optim")  # Adam's step counters: 2 restored, then 1 more
    assert {float(t) for name, t in optimizer.items() if name.endswith(".step")} == {3.0}

    ledger = Ledger.from_dict(json.loads((tmp_path / "checkpoint" / "ledger.json").read_text()))
    counts = ledger.fresh_train_counts_by_prompt(0)
    assert sum(counts.values()) == 3 * 4 and set(counts.values()) <= {0, 1}
    requeued = [gid for gid in json.loads((step3 / "ledger.json").read_text())["groups"]
                if any(e.reason and "resumed" in e.reason for e in ledger.history(gid))]
    assert len(requeued) == 4
    # Each was generated again after the resume. Which groups of those in flight make step 3's
    # batch is the order they finish in (the window streams), so none is promised a place
    # there; what is promised is that none was trained twice as fresh (the counts above).
    for gid in requeued:
        states = [e.state for e in ledger.history(gid)]
        resumed = next(i for i, e in enumerate(ledger.history(gid))
                       if e.reason and "resumed" in e.reason)
        assert State.GENERATING in states[resumed:], (gid, states)
        assert states.count(State.TRAINED_FRESH) <= 1, (gid, states)


@pytest.mark.slow
def test_a_killed_trainer_goes_on_from_its_last_checkpoint(tiny_model_dir, tmp_path,
                                                           monkeypatch):
    """Fault injection: the trainer's process is killed after step 2 is logged, before its
    checkpoint. The run stops with an error naming the trainer rank and what it was doing;
    `resume=auto` goes on from step 1's checkpoint (step 2's was never completed) and the
    ledger shows every group of the finished run trained exactly once as fresh."""
    import ray

    from eddyrl.config import load_config
    from eddyrl.core.ledger import Ledger
    from eddyrl.errors import EddyError
    from eddyrl.launch import train

    def kill_trainer(metrics):
        if metrics["step"] == 2:
            (actor,) = [a for a in ray.util.list_named_actors(True) if a["name"] == "trainer-0"]
            ray.kill(ray.get_actor("trainer-0", namespace=actor["namespace"]), no_restart=True)

    def config(*overrides):
        return load_config(overrides=[f"model.path={tiny_model_dir}", f"run_dir={tmp_path}",
                                      "platform=cpu", "cluster.runtime=ray", *RUN,
                                      "loop.steps=3", *overrides])

    with monkeypatch.context() as patch:
        patch.setattr(ray, "shutdown", lambda: None)
        # one rank: nothing to rebuild it from, so the run ends, saying why
        with pytest.raises(EddyError, match=r"trainer rank 0 \(node .*\) was lost during save to "
                           r".*: actor died [\s\S]*; the run cannot go on without it \(it was the "
                           r"only trainer rank: no survivor holds the state\)"):
            train(config(), on_step=kill_trainer)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000001"]  # no half one
    try:
        summary = json.loads(train(config("resume=auto")).read_text())
    finally:
        ray.shutdown()
    assert summary["steps"] == 3 and summary["resumed_from"] == str(checkpoints / "step_000001")
    assert not list(checkpoints.glob(".*"))  # the dead trainer's unfinished write is cleared
    ledger = Ledger.from_dict(json.loads((tmp_path / "checkpoint" / "ledger.json").read_text()))
    groups = ledger.to_dict()["groups"].values()
    fresh = [g for g in groups if any(h["state"] == "trained_fresh" for h in g["history"])]
    assert len(fresh) == 3 * 4
    assert all([h["state"] for h in g["history"]].count("trained_fresh") == 1 for g in fresh)
    report = ledger.check_exactly_once([g["prompt_index"] for g in fresh], epoch=0)
    assert not report.missing and not report.duplicated
