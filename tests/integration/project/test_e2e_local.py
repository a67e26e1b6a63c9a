"""`cluster.runtime = local`: the same controller with the rollout engine and the trainer in
this process, no Ray (issue 20); what `auto` (the default) picks for a job that fits one
process. Pinned to the Ray runtime: the same run gives the same samples, losses and weights;
an asynchronous run (K = 1, generation beside training in the trainer's thread) keeps C3 and
the exactly-once ledger."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eddyrl.errors import ConfigError

RUN = ["loop.batch_prompts=4", "loop.eval_every=0", "rollout.n_samples=4",
       "rollout.max_new_tokens=16", "data.train_size=32", "data.eval_size=4",
       "cluster.threads_per_worker=1", "data.reward_fn=reward_fixtures:length_reward",
       "algorithm.dynamic_sampling=false"]
# per-step numbers that depend on what was sampled and trained, not on timing
SAME = ("loss", "grad_norm", "tokens", "reward_mean", "response_len_mean", "groups_kept",
        "mismatch_abs_max")


def _run(tmp_path, tiny_model_dir, name, *overrides):
    from eddyrl.config import load_config
    from eddyrl.launch import train

    run_dir = tmp_path / name
    config = load_config(overrides=[f"model.path={tiny_model_dir}", f"run_dir={run_dir}",
                                    "platform=cpu", *RUN, *overrides])
    summary = json.loads(train(config).read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()][1:]
    return run_dir, summary, steps


def _weights(run_dir):
    return load_file(str(next((run_dir / "checkpoint").glob("*.safetensors"))))


@pytest.mark.slow
def test_the_local_runtime_trains_exactly_as_ray_does(tiny_model_dir, tmp_path):
    ray_dir, on_ray_summary, on_ray = _run(tmp_path, tiny_model_dir, "ray", "loop.steps=2",
                                           "cluster.runtime=ray")
    local_dir, summary, local = _run(tmp_path, tiny_model_dir, "local", "loop.steps=2",
                                     "cluster.runtime=local")
    assert (on_ray_summary["runtime"], summary["runtime"]) == ("ray", "local")
    assert len(local) == len(on_ray) == 2
    for a, b in zip(local, on_ray):
        assert {k: a.get(k) for k in SAME} == {k: b.get(k) for k in SAME}
    assert summary["rollout_workers"] == 1
    want, got = _weights(ray_dir), _weights(local_dir)
    assert want.keys() == got.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.slow
def test_an_asynchronous_local_run_keeps_staleness_and_exactly_once(tiny_model_dir, tmp_path):
    from eddyrl.core.ledger import Ledger

    run_dir, summary, steps = _run(tmp_path, tiny_model_dir, "async", "loop.steps=3",
                                   "cluster.runtime=local", "window.max_staleness=1")
    assert len(steps) == 3 and max(m["staleness_max"] for m in steps) <= 1  # C3
    assert summary["ledger"]["generating"] == 0 and summary["ledger"]["queued"] == 0
    ledger = Ledger.from_dict(json.loads((run_dir / "checkpoint" / "ledger.json").read_text()))
    counts = ledger.fresh_train_counts_by_prompt(0)
    assert sum(counts.values()) == 3 * 4 and set(counts.values()) <= {0, 1}


def test_settings_the_local_runtime_cannot_run_are_refused_by_name():
    from eddyrl.config import load_config

    for overrides, match in (
            (["train.num_workers=2"], "one trainer rank in this process"),
            (["cluster.placement=colocated", "window.max_staleness=0"],
             "cluster.placement = colocated"),
            (["cluster.address=127.0.0.1:6379"], "joins a Ray cluster"),
            (["rollout.num_workers=2", "elastic.enabled=true"], "elastic")):
        with pytest.raises(ConfigError, match=match):
            load_config(overrides=["cluster.runtime=local", *overrides])


def test_auto_runs_local_exactly_when_the_job_fits_one_process():
    from eddyrl.config import load_config

    assert load_config().cluster.runtime == "auto"
    assert load_config().runtime_kind() == "local"  # the default job, `eddy train`
    for overrides in (["rollout.num_workers=2"], ["rollout.engine=vllm"],
                      ["window.max_staleness=1"], ["cluster.runtime=local"]):
        assert load_config(overrides=overrides).runtime_kind() == "local", overrides
    for overrides in (["train.num_workers=2"], ["cluster.address=127.0.0.1:6379"],
                      ["cluster.placement=colocated", "window.max_staleness=0"],
                      ["rollout.num_workers=2", "elastic.enabled=true"],
                      ["cluster.runtime=ray"]):
        assert load_config(overrides=overrides).runtime_kind() == "ray", overrides
