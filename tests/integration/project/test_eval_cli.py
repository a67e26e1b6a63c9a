"""`eddy eval <checkpoint>`: the training run's held-out evaluation, on a saved model."""

import json

import pytest

from eddyrl.cli import main


def test_eval_scores_a_checkpoint(tiny_model_dir, capsys):
    assert main(["eval", tiny_model_dir, "data.eval_size=12", "platform=cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["eval_prompts"] == 12 and 0.0 <= result["eval_accuracy"] <= 1.0


def test_eval_of_the_warm_start_is_modest_and_non_zero(capsys):
    from eddyrl.models.tiny import WARMSTART_DIR

    assert main(["eval", str(WARMSTART_DIR), "data.eval_size=100", "platform=cpu"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0.05 < result["eval_accuracy"] < 0.5


@pytest.mark.parametrize("path, message", [("/no/such/dir", "directory does not exist"),
                                           ("/tmp", "has no config.json")])
def test_eval_of_a_bad_checkpoint_is_named(path, message, capsys):
    assert main(["eval", path, "platform=cpu"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint '{path}'" in err and message in err


def test_eval_refuses_a_corrupt_run_checkpoint_unless_told_not_to_verify(tiny_model_dir,
                                                                         tmp_path, capsys):
    """`eddy eval` scored a checkpoint that failed its manifest without a word (issue 19)."""
    import asyncio
    import shutil

    from eddyrl import checkpoints

    async def fill(tmp):
        shutil.copytree(tiny_model_dir, tmp)
    path = asyncio.run(checkpoints.write(tmp_path, 3, fill))
    config = path / "config.json"
    text = config.read_text()
    config.write_text(text[:-1] + (" " if text[-1] != " " else "\n"))  # same size, still a
    # valid config: only the hash tells
    assert main(["eval", str(path), "data.eval_size=4", "platform=cpu"]) == 2
    assert "config.json does not match its sha256" in capsys.readouterr().err
    assert main(["eval", str(path), "data.eval_size=4", "platform=cpu", "--no-verify"]) == 0
    assert json.loads(capsys.readouterr().out)["eval_prompts"] == 4
