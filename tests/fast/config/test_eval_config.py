"""Issue 34, item 2: `eddy eval <run>/checkpoint` scores with the run's own data. Before: it
scored a model trained on the user's file against the built-in task (0.618 on 500 prompts),
and `data.eval_path=...` alone was refused ("must be given together")."""

import json

from eddyrl.config import load_config, to_yaml
from eddyrl.config.resumed import load_eval_config


def user_run(tmp_path):
    rows = "".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(8))
    (tmp_path / "train.jsonl").write_text(rows)
    (tmp_path / "test.jsonl").write_text(rows)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (run_dir / "checkpoint").mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    (run_dir / "config.yaml").write_text(to_yaml(load_config(overrides=[
        f"run_dir={run_dir}", f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'test.jsonl'}", "data.reward_fn=reward_fixtures:zero"])))
    return run_dir


def test_a_runs_checkpoint_is_scored_with_the_runs_data_and_reward(tmp_path):
    run_dir = user_run(tmp_path)
    for given, scored in ((run_dir / "checkpoint", run_dir / "checkpoint"),
                          (run_dir, run_dir / "checkpoint"),
                          (run_dir / "checkpoints" / "step_000002",
                           run_dir / "checkpoints" / "step_000002")):
        config, checkpoint, line = load_eval_config(str(given), None, [])
        assert config.data.eval_path == str(tmp_path / "test.jsonl")
        assert config.data.reward_fn == "reward_fixtures:zero"
        assert checkpoint == str(scored)
        assert line == f"eval: with the run's saved config ({run_dir}/config.yaml)"


def test_overrides_and_a_given_config_still_win(tmp_path):
    run_dir = user_run(tmp_path)
    config, _, _ = load_eval_config(str(run_dir), None, ["data.eval_size=3"])
    assert config.data.eval_size == 3 and config.data.reward_fn == "reward_fixtures:zero"
    config, _, line = load_eval_config(str(run_dir), "tiny_cpu", [])
    assert config.data.eval_path is None and line is None


def test_an_eval_file_alone_is_taken_for_evaluation(tmp_path):
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "q", "answer": "1"}) + "\n")
    model = tmp_path / "model"
    model.mkdir()
    config, checkpoint, line = load_eval_config(
        str(model), None, [f"data.eval_path={tmp_path / 'test.jsonl'}"])
    assert config.data.eval_path == str(tmp_path / "test.jsonl") and line is None
    assert checkpoint == str(model)
