"""`eddy sft --experts N`: the bundled tiny model as a mixture of experts (models/tiny_moe.py);
refused by name with the user's model and data, and below the 2 experts each token is routed
to, before any work."""

import pytest

from eddyrl.cli import main


@pytest.mark.parametrize("argv, named", [
    (["--model", "m", "--data", "d.jsonl", "--experts", "4"],
     "--experts: for the bundled tiny model's tasks only"),
    (["--experts", "1"], "eddy sft: experts 1: must be >= 2 (each token is routed to 2)"),
    (["--experts", "4", "--hidden-size", "100"], "hidden size 100: must be a positive multiple"),
])
def test_bad_expert_flags_are_refused_before_any_work(argv, named, tmp_path, capsys):
    assert main(["sft", "--out", str(tmp_path / "out"), *argv]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
