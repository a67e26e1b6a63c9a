"""`eddy sft --help` explains every flag, and a flag of one source (the bundled tiny tasks, or
the user's model and file) given with the other is refused by name before any work."""

import argparse

import pytest

from eddyrl.cli import build_parser, main


def sft_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return commands.choices["sft"]


def test_every_sft_flag_has_a_help():
    actions = [a for a in sft_parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert len(actions) >= 20  # the walk sees the argument groups' flags too
    silent = [a.option_strings or a.dest for a in actions
              if not (a.help and a.help.strip() and a.help != argparse.SUPPRESS)]
    assert not silent, f"eddy sft flags without a help: {silent}"


def test_the_user_data_flags_are_in_the_help():
    text = sft_parser().format_help()
    for flag in ("--model", "--data", "--prompt-key", "--response-key", "--max-length",
                 "--overflow", "--epochs", "--eval-fraction", "--task"):
        assert flag in text


@pytest.mark.parametrize("argv, named", [
    (["--model", "m", "--data", "d.jsonl", "--task", "cipher", "--layers", "2"],
     "--task, --layers: for the bundled tiny model's tasks only"),
    (["--prompt-key", "question", "--eval-fraction", "0.1"],
     "--prompt-key, --eval-fraction: for your own model and data only"),
    (["--data", "d.jsonl"], "--model and --data go together"),
])
def test_a_flag_of_the_other_source_is_refused(argv, named, tmp_path, capsys):
    assert main(["sft", "--out", str(tmp_path / "out"), *argv]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
