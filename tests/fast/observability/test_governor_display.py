"""The stability governor's decisions where a user sees them: the progress bar's K and its move,
and `eddy report`'s summary of every move with its reason."""

import io

from rich.console import Console

from eddyrl.observability.report import governor_moves
from eddyrl.ui import TrainProgress


def _bar(rows):
    progress = TrainProgress(10, out=Console(file=io.StringIO(), width=200))
    for row in rows:
        progress.update(row)
    out = Console(file=io.StringIO(), width=200, force_terminal=False)
    out.print(progress.progress.get_renderable())
    return out.file.getvalue()


def test_the_bar_shows_k_and_marks_the_step_that_moved_it():
    line = _bar([{"step": 1, "governor_k": 3, "governor_action": "hold"},
                 {"step": 2, "governor_k": 1, "governor_action": "lower"}])
    assert "K 1 (lowered)" in line, line
    assert "K 2 (raised)" in _bar([{"step": 1, "governor_k": 2, "governor_action": "raise"}])
    held = _bar([{"step": 1, "governor_k": 2, "governor_action": "hold"}])
    assert "K 2" in held and "(" not in held.split("K 2")[1][:3]
    assert "K " not in _bar([{"step": 1, "reward_mean": 0.5}])  # governor off: nothing shown


def test_the_report_lists_each_move_with_its_reason_and_the_last_k():
    rows = [{"step": 0, "eval_accuracy": 0.1},
            {"step": 1, "governor_k": 4, "governor_action": "hold", "governor_reason": "calm 1/5"},
            {"step": 2, "governor_k": 2, "governor_action": "lower",
             "governor_reason": "mismatch_kl 0.02 > 0.01 at lag 4"},
            {"step": 3, "governor_k": 3, "governor_action": "raise",
             "governor_reason": "calm for 5 step(s)"},
            {"step": 4, "governor_k": 3, "governor_action": "hold", "governor_reason": "calm 1/5"}]
    assert governor_moves(rows) == {"k": 3, "correction_scale": 1.0, "moves": [
        {"step": 2, "action": "lower", "k": 2, "reason": "mismatch_kl 0.02 > 0.01 at lag 4",
         "correction_scale": 1.0},
        {"step": 3, "action": "raise", "k": 3, "reason": "calm for 5 step(s)",
         "correction_scale": 1.0}]}


def test_the_bar_and_the_report_show_the_correction_bounds_when_narrowed():
    narrowed = {"step": 1, "governor_k": 0, "governor_action": "narrow",
                "governor_reason": "mismatch_kl 0.02 > 0.01; all samples on-policy (lag 0): a "
                                   "smaller K cannot help: correction bounds at scale 0.5",
                "governor_correction_scale": 0.5}
    line = _bar([narrowed])
    assert "K 0 (bounds narrowed)" in line and "bounds x0.5" in line, line
    assert "bounds x" not in _bar([{"step": 1, "governor_k": 2, "governor_action": "hold",
                                    "governor_correction_scale": 1.0}])
    moves = governor_moves([narrowed])
    assert moves["correction_scale"] == 0.5
    assert [(m["action"], m["correction_scale"]) for m in moves["moves"]] == [("narrow", 0.5)]
