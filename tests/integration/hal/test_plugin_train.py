"""`eddy train` on an outside vendor's platform, the example plug-in (the template in
examples/platform_plugin): its Ray resource declared by the local Ray, each actor on its own
device index, Eddy's phases in the vendor's profiler ranges, the platform recorded, and a
resume on another platform refused."""

import json

import pytest
from tests.integration.hal.test_plugin import ENTRY, _hook_log, _run, _site

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = ["cluster.runtime=ray", "train.num_workers=2", "rollout.num_workers=2", "loop.steps=1",
       "loop.batch_prompts=4", "rollout.n_samples=4", "rollout.max_new_tokens=16",
       "data.train_size=32", "data.eval_size=8", "loop.eval_every=0",
       "cluster.threads_per_worker=1", "algorithm.dynamic_sampling=false"]
PHASES = {"eddy.rollout.generate", "eddy.rollout.forward", "eddy.train.step",
          "eddy.train.forward", "eddy.train.backward", "eddy.train.optimizer",
          "eddy.weights.export", "eddy.weights.receive", "eddy.weights.apply"}


def test_a_run_on_the_example_plugin(tmp_path, tiny_model_dir):
    site = _site(tmp_path, ENTRY)
    run, log = tmp_path / "run", tmp_path / "hooks.jsonl"
    args = ["-m", "eddyrl.cli", "train", f"model.path={tiny_model_dir}", f"run_dir={run}"]
    # chosen by the variable alone, as a vendor's users would: `platform` stays auto
    out = _run(site, *args, *RUN, env={"EDDY_PLATFORM": "example",
                                       "EXAMPLE_PLATFORM_LOG": str(log)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["runtime"] == "ray"

    # 1. four actors, four devices: each claimed its own index of the node's four
    devices = summary["devices"]
    bindings = devices["trainer"] + devices["rollout"]
    assert [b["how"] for b in bindings] == ["claimed"] * 4, devices
    assert sorted(b["index"] for b in bindings) == [0, 1, 2, 3], devices
    assert all(b["local"] == 0 and b["platform"] == "example" for b in bindings)
    hooks = _hook_log(log)
    bound = {h["pid"]: h["index"] for h in hooks if h["hook"] == "bind_device"}
    assert len(bound) == 4 and sorted(bound.values()) == [0, 1, 2, 3], bound
    assert json.loads((run / "placement.json").read_text())["devices"] == devices

    # 2. the vendor profiler saw Eddy's phases, from the actors' processes
    ranges = {h["name"] for h in hooks if h["hook"] == "range_start"}
    assert PHASES <= ranges, sorted(PHASES - ranges)
    assert {h["pid"] for h in hooks if h["hook"] == "range_start"} <= set(bound)
    starts = sum(h["hook"] == "range_start" for h in hooks)
    assert starts == sum(h["hook"] == "range_end" for h in hooks)  # every range ended

    # 3. the platform is recorded, not "auto"
    config = (run / "config.yaml").read_text()
    assert "platform: example" in config and "platform: auto" not in config
    assert summary["platforms"] == {"rollout": "example", "train": "example"}

    # 4. a resume where the variable is not set would run on the CPU: refused, naming both
    out = _run(site, *args, *RUN[:3], "loop.steps=2", "resume=auto")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    message = out.stderr.strip().splitlines()[-1]
    assert "platform 'example'" in message and "resolved 'cpu'" in message, message
    assert "train.platform=cpu" in message or "platform=cpu" in message, message
    assert json.loads((run / "summary.json").read_text()) == summary  # the run is untouched
