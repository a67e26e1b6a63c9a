"""`eddy sft --model DIR --data FILE`: a DIR that is not a Hugging Face model directory is
refused naming it and what it lacks, before any work. (The user's model trained on the user's
file, and the other refusals: test_sft_user_data.py.)"""

import pytest

from eddyrl.errors import ConfigError

from sft_user_cases import sft, sum_rows, write_jsonl


def test_a_model_dir_that_is_not_a_model_is_refused(tmp_path):
    data = write_jsonl(tmp_path / "sums.jsonl", sum_rows(2))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"--model '.*notes'.*no config.json and no "
                       r"\*.safetensors, so it is not a Hugging Face model directory"):
        sft(str(tmp_path / "notes"), data, tmp_path / "out", steps=1)
