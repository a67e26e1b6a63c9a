"""Issue 34, item 6, end to end: `eddy train` on the tiny model writes the held-out samples to
samples.jsonl, the warm start's and each evaluated step's, and `eddy eval --show` shows them.
(Choosing and writing the rows, and a resume cutting them: test_samples.py.)"""

import json


def test_a_run_writes_samples_and_eval_shows_them(tiny_model_dir, tmp_path, capsys):
    from eddyrl.cli import main

    run_dir = tmp_path / "run"
    assert main(["train", f"model.path={tiny_model_dir}", f"run_dir={run_dir}",
                 "loop.steps=1", "loop.batch_prompts=2", "rollout.n_samples=2",
                 "rollout.max_new_tokens=8", "data.train_size=8", "data.eval_size=3",
                 "loop.max_idle_steps=0", "observe.samples=2", "observe.trace=false",
                 "platform=cpu"]) == 0
    lines = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 0, 1, 1]  # the warm start, then step 1
    assert set(lines[0]) == {"step", "prompt", "response", "answer", "reward"}
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--show", "2", "platform=cpu"]) == 0
    shown = json.loads(capsys.readouterr().out)["samples"]
    assert len(shown) == 2 and shown[0]["prompt"] == lines[0]["prompt"]
