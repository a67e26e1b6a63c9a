"""Issue 34, item 1, end to end: `eddy train` on the tiny model with a reward that never
differs stops after loop.max_idle_steps, says why, warns about the starting model's equal
held-out rewards and leaves a resumable run. (The watch and the warning themselves:
test_nothing_learned.py.)"""

import json
import os
import subprocess
import sys

from tree import SUPPORT_DIR as TESTS  # noqa: E402 (on the runs' PYTHONPATH)


def test_a_run_whose_reward_never_differs_stops_with_the_reason(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "eddyrl.cli", "train", f"model.path={tiny_model_dir}",
           f"run_dir={run_dir}", "loop.steps=20", "loop.max_idle_steps=2", "loop.batch_prompts=4",
           "rollout.n_samples=4", "rollout.max_new_tokens=8", "data.train_size=32",
           "data.eval_size=4", "loop.eval_every=0", "data.reward_fn=reward_fixtures:zero"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "EDDY_PLATFORM": "cpu",
                              "PYTHONPATH": os.pathsep.join([TESTS,
                                                             os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stopped: no sample was trained in the last 2 steps" in out.stdout, out.stdout
    assert "Reward function: reward_fixtures:zero" in out.stdout
    assert "every held-out response of the starting model got reward 0" in out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["stopped_early"].startswith("stopped: no sample")
    assert (run_dir / "checkpoint").is_dir()  # the run stopped cleanly: resumable
