"""The training bar (`ui.TrainProgress`): an ETA from the steps this process ran, and the
held-out accuracy with the step it was measured at. A fake clock makes the ETA exact."""

import io

from rich.console import Console

from eddyrl.ui import TrainProgress


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def bar_line(progress: TrainProgress) -> str:
    out = Console(file=io.StringIO(), width=200, force_terminal=False)
    out.print(progress.progress.get_renderable())
    return out.file.getvalue()


def run_steps(progress: TrainProgress, clock: Clock, steps, eval_at=()) -> None:
    for step in steps:
        clock.now += 10.0  # ten seconds a step
        metrics = {"step": step, "reward_mean": 0.5, "tokens_per_s": 100.0}
        if step in eval_at:
            metrics["eval_accuracy"] = step / 100
        progress.update(metrics)


def make(steps: int) -> tuple[TrainProgress, Clock]:
    clock = Clock()
    progress = TrainProgress(steps, out=Console(file=io.StringIO(), width=200), clock=clock)
    return progress, clock


def test_the_bar_shows_the_time_left_at_the_measured_pace():
    progress, clock = make(10)
    run_steps(progress, clock, range(1, 5))
    assert "4/10" in bar_line(progress)
    assert "eta 01:00" in bar_line(progress)  # 6 steps left at 10 s each


def test_a_resumed_run_counts_only_its_own_steps_in_the_eta():
    progress, clock = make(100)
    run_steps(progress, clock, range(41, 45))  # resumed after step 40
    line = bar_line(progress)
    assert "44/100" in line
    assert "eta 09:20" in line, line  # 56 steps left at 10 s, not at 44 steps per 40 s


def test_the_held_out_accuracy_names_the_step_it_was_measured_at():
    progress, clock = make(10)
    run_steps(progress, clock, range(1, 6), eval_at={2})
    line = bar_line(progress)
    assert "step 5" in line
    assert "held-out acc 0.020 (step 2)" in line, line
