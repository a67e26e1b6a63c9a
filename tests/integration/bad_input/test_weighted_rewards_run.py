"""Issue 34, item 5, end to end: `eddy train` on the tiny model with two rewards and their
weights (`data.rewards`), scored in worker processes: metrics.jsonl has each reward's mean
beside the combined one, which is their weighted sum; every held-out sample shows both; held-out
accuracy counts the first listed. (The checks and the sum themselves:
tests/fast/config/test_weighted_rewards.py.)"""

import json
import os
import subprocess
import sys

import pytest

from tree import SUPPORT_DIR as TESTS  # noqa: E402 (on the runs' PYTHONPATH)
# the first, as the correctness reward would be, weight 1 by default; the second, weighted so
# that the sum passes 1 where the first does not (12 tokens of the random model: 12 / 50 * 10)
REWARDS = ("[{fn: 'reward_fixtures:digit_share'}, "
           "{fn: 'reward_fixtures:length_reward', weight: 10, name: length}]")


def test_two_weighted_rewards_are_each_logged_and_summed(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "eddyrl.cli", "train", f"model.path={tiny_model_dir}",
           f"run_dir={run_dir}", "loop.steps=2", "loop.batch_prompts=4", "rollout.n_samples=4",
           "rollout.max_new_tokens=12", "data.train_size=32", "data.eval_size=6",
           "observe.samples=6", "loop.max_idle_steps=0", "user_code.reward.mode=process",
           f"data.rewards={REWARDS}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "EDDY_PLATFORM": "cpu",
                              "PYTHONPATH": os.pathsep.join([TESTS,
                                                             os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "reward_mean" in m]
    evals = [m for m in lines if "eval_accuracy" in m]
    assert len(steps) == 2 and evals and evals[0]["step"] == 0
    for m in steps:
        assert m["reward_mean"] == pytest.approx(m["reward/digit_share"] +
                                                 10 * m["reward/length"])
    for m in evals:
        assert m["eval_reward_mean"] == pytest.approx(m["eval_reward/digit_share"] +
                                                      10 * m["eval_reward/length"])
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    first = [s for s in samples if s["step"] == 0]
    assert len(first) == 6  # every held-out prompt: the accuracy can be worked out from them
    for s in samples:
        parts = s["rewards"]
        assert set(parts) == {"digit_share", "length"}
        assert parts["length"] == pytest.approx(len(s["response"]) / 50.0)
        assert s["reward"] == pytest.approx(parts["digit_share"] + 10 * parts["length"])
    # accuracy counts the first reward reaching 1, not the sum (which some samples pass)
    assert any(s["reward"] >= 1.0 > s["rewards"]["digit_share"] for s in first)
    assert evals[0]["eval_accuracy"] == \
        sum(s["rewards"]["digit_share"] >= 1.0 for s in first) / 6
    assert "reward errors" not in out.stdout
