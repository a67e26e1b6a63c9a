"""`eddy train`, and how a run that ended early says so in one line (where it stopped, how to
go on); then the commands on what a run leaves: `eddy eval` (a checkpoint's held-out
accuracy) and `eddy report` (the run's plots)."""

from __future__ import annotations

import argparse
import json
import sys

from .cli_config import split_config_args
from .errors import EddyError, WorkerCallError, WorkerLost


def cmd_train(ns: argparse.Namespace) -> int:
    from . import stopping
    from .config.resumed import load_run_config
    from .launch import resolve_run_dir, train
    from .ui import TrainProgress, console

    path, overrides = split_config_args(ns.args)
    # a resume goes on with the run's saved config, the command line's overrides on top
    config, against_saved = load_run_config(path, overrides)
    if against_saved:
        console.print(against_saved, highlight=False, markup=False)
    # resolved once, here: a stopped run's message says where to resume
    config.run_dir = config.run_dir or str(resolve_run_dir(config))
    finished: list[int] = []  # the steps logged so far

    def on_step(metrics: dict) -> None:
        finished.append(metrics["step"])
        progress.update(metrics)

    try:  # every runtime: SIGTERM and SIGHUP stop the run as Ctrl-C does (`stopping.py`)
        with stopping.signals_stop_the_run(), TrainProgress(config.loop.steps) as progress:
            summary_path = train(config, on_step=on_step)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP: the run has shut down
        return _stopped(config, max(finished, default=0))
    except BaseException as exc:  # a full disk, a worker's process (or node) lost: one line
        _raise_as_one_line(exc, config)
        raise
    summary = json.loads(summary_path.read_text())
    if summary.get("resumed_from"):
        console.print(f"resumed from {summary['resumed_from']} (step {summary['resumed_step']}, "
                      f"{summary['requeued_groups']} groups generated again)", highlight=False)
    if summary.get("reward_errors"):  # each scored 0: a reward that always fails trains nothing
        console.print(f"reward errors: {summary['reward_errors']} samples scored 0 (the first: "
                      f"{summary.get('reward_first_error', 'before a resume')})",
                      highlight=False, markup=False)
    console.print(f"held-out accuracy: {summary['initial_eval_accuracy']:.3f} -> "
                  f"{summary['final_eval_accuracy']:.3f} in {summary['wall_seconds']:.0f} s "
                  f"({summary['steps']} steps)", highlight=False)
    if summary.get("stopped_early"):  # a run that could not learn (core/idle.py)
        console.print(summary["stopped_early"], highlight=False, markup=False)
        print(summary_path)
        return 1
    print(summary_path)
    return 0


def _raise_as_one_line(exc: BaseException, config) -> None:
    """Raise an error that ended the run early as the CLI's one line, with how to go on: a full
    disk (however wrapped: `disk_full.py`), a lost worker; else return (a traceback)."""
    import logging

    from . import disk_full

    full = disk_full.find(exc)
    if full is None and not isinstance(exc, (WorkerCallError, WorkerLost)):
        return
    # the run's tasks cut short report themselves destroyed as the interpreter exits, after
    # the error line: expected, as for a stop
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    if full is not None:
        raise EddyError(f"{full.line(config.run_dir)}; {_how_to_go_on(config)}") from None
    raise WorkerCallError(f"{exc}; {_how_to_go_on(config)}") from None


def _stopped(config, step: int) -> int:
    """One line for a run stopped by a signal: where, and how to go on; the exit status a
    shell gives a process that signal ended (130 for Ctrl-C, 143 for SIGTERM, 129 SIGHUP)."""
    import logging

    from . import stopping

    signum = stopping.stop_signal()
    # tasks the stop cancelled report themselves destroyed as the interpreter exits: expected
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    where = f"at step {step}" if step else "before its first step"
    print(f"eddy: stopped {where} ({signum.name}); {_how_to_go_on(config)}", file=sys.stderr)
    return stopping.exit_status(signum)


def _how_to_go_on(config) -> str:
    """After a run ended early: what to do, checked against what resume=auto would do."""
    from .resume_advice import how_to_go_on

    return how_to_go_on(config.run_dir, config.checkpoint.every)


def cmd_eval(ns: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from .config.resumed import load_eval_config
    from .launch import evaluate_checkpoint

    path, overrides = split_config_args(ns.args)
    # a run's checkpoint is scored with the run's saved config (its data, reward, task)
    config, checkpoint, source = load_eval_config(ns.checkpoint, path, overrides)
    if source:
        print(source, file=sys.stderr)
    with tempfile.TemporaryDirectory() as data_dir:
        result = evaluate_checkpoint(config, checkpoint, Path(data_dir),
                                     verify=not ns.no_verify, show=ns.show)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def cmd_report(ns: argparse.Namespace) -> int:
    from .observability.report import report

    result = report(ns.run_dir)
    for path in result["written"]:
        print(path)
    for role, ratio in result.get("idle_ratio", {}).items():
        print(f"{role} idle: {ratio:.1%}")
    if "no_trace" in result:
        print(f"# {result['no_trace']}")
    return 0
