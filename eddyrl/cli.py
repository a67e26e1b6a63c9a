"""`eddy`: the command line. Each sub-command is a thin shell over a library function."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .cli_sft import add_sft_parser
from .errors import EddyError, WorkerCallError, WorkerLost


def _split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[config.yaml] [key=value ...]`: the first argument is a file (or a bundled
    config's name) unless it has an '='."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def cmd_platforms(_: argparse.Namespace) -> int:
    from .hal import detect, get_platform, known_platforms
    from .ui import platforms_table

    rows = [get_platform(name, require_available=False).describe() for name in known_platforms()]
    platforms_table(rows, chosen=detect().name)
    return 0


def cmd_platforms_check(ns: argparse.Namespace) -> int:
    """The platform contract against one platform: a table, exit 1 when a check failed."""
    from .platform_checks import CHECKS, run_checks, select
    from .ui import platform_checks_table

    selected = select(ns.only)  # an unknown --only name fails here, before any check runs
    if any(check.group == "engines" for check in selected):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a bar per model load would bury the progress
    total = len(selected)
    done: list = []

    def progress(result) -> None:
        done.append(result)
        print(f"[{len(done)}/{total}] {result.name}: {result.status} "
              f"({result.seconds:.1f} s)", file=sys.stderr, flush=True)

    results = run_checks(ns.name, ns.only, on_result=progress)
    platform_checks_table(ns.name, results, {name: c.summary for name, c in CHECKS.items()})
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"platform": ns.name, "results": [r.as_dict() for r in results]}, f,
                      indent=2)
    return 1 if any(r.status == "failed" for r in results) else 0


def cmd_config_show(ns: argparse.Namespace) -> int:
    from .config import load_config, read_yaml, resolve_config, to_yaml

    path, overrides = _split_config_args(ns.args)
    resolved = resolve_config(path)
    # a scenario (a `sim` section) is shown as `eddy sim` reads it
    if (resolved is not None and resolved.is_file() and "sim" in read_yaml(resolved)) or \
            any(item.startswith("sim.") for item in overrides):
        from .sim.config import load_scenario

        config = load_scenario(resolved, overrides)
    else:  # without the model's files: a recipe shows before its model is downloaded
        config = load_config(resolved, overrides, check_files=False)
    if getattr(ns, "diff", False):  # what a mode or recipe changes, and nothing else
        from .config.resumed import differences

        for key, _, value in differences(type(config)(), config):
            print(f"{key}: {json.dumps(value)}")
        return 0
    print(to_yaml(config), end="")
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    """The run's predicted memory per role and device; exit status 1 when it does not fit."""
    from .config import load_config
    from .plan.memory_plan import plan_memory
    from .plan.report import format_plan, plan_dict

    if ns.cluster is not None:
        return _plan_cluster(ns)
    path, overrides = _split_config_args(ns.args)
    config = load_config(path, overrides, check_files=False)  # a recipe plans without weights
    plan = plan_memory(config, ns.device)
    print(json.dumps(plan_dict(plan), indent=2) if ns.json else format_plan(plan))
    return 0 if plan.fits else 1


def _plan_cluster(ns: argparse.Namespace) -> int:
    """`eddy plan --cluster SCENARIO [key=value ...]`: the simulator's search; exit status 1
    when no candidate could run."""
    from .plan.cluster import format_cluster_plan, plan_cluster

    if ns.device is not None:
        print("eddy: error: --device and --cluster: the scenario names its devices "
              "(sim.rollout.accelerator, sim.train.accelerator)", file=sys.stderr)
        return 2
    plan = plan_cluster(_scenario(ns.cluster), list(ns.args), ns.budget, ns.steps, ns.top)
    print(json.dumps(plan, indent=2) if ns.json else format_cluster_plan(plan))
    return 0 if plan["choices"] else 1


def cmd_train(ns: argparse.Namespace) -> int:
    from . import stopping
    from .config.resumed import load_run_config
    from .launch import resolve_run_dir, train
    from .ui import TrainProgress, console

    path, overrides = _split_config_args(ns.args)
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

    path, overrides = _split_config_args(ns.args)
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


def _scenario(name: str | None) -> str | None:
    """A scenario file, or the name of a bundled one (`dora_64`, i.e. `sim/dora_64`)."""
    from .config import resolve_config

    path = resolve_config(name, folder="sim")
    return None if path is None else str(path)


def cmd_sim(ns: argparse.Namespace) -> int:
    from .sim.config import load_scenario
    from .sim.runtime import simulate
    from .ui import console

    path, overrides = _split_config_args(ns.args)
    config = load_scenario(_scenario(path), overrides)
    summary = simulate(config, log=lambda m: console.print(_step_line(m), highlight=False),
                       trace_path=ns.trace)
    console.print(f"simulated {summary['simulated_s']:.1f} s in {summary['wall_s']:.2f} s "
                  f"wall ({summary['rollout_instances']} rollout instances, "
                  f"{summary['train_groups']} trainer groups): rollout idle "
                  f"{summary['rollout_idle']:.1%}, trainer idle {summary['train_idle']:.1%}, "
                  f"control plane {summary['cpu_per_step_fraction']:.2%} of simulated time",
                  highlight=False)
    if summary["tool_calls"]:
        console.print(f"tool calls {summary['tool_calls']} ({summary['tool_failures']} failed), "
                      f"{summary['tool_wait_s']:.0f} s waited in all", highlight=False)
    return 0


def _step_line(m: dict) -> str:
    if not m.get("step"):
        return "step 0 (evaluation)"
    return (f"step {m['step']}: {m['step_s']:.1f} s (rollout wait {m['rollout_s']:.1f}, train "
            f"{m['train_s']:.1f}, sync {m['sync_s']:.2f}), {m['tokens_per_s']:.0f} tokens/s, "
            f"staleness max {m['staleness_max']}")


def cmd_bench_sim(ns: argparse.Namespace) -> int:
    import platform as host
    from pathlib import Path

    from .sim.policies import compare

    path, overrides = _split_config_args(ns.args)
    scenario = _scenario(path)
    policies = ns.policies.split(",")
    print(f"# eddy bench sim {scenario} {' '.join(overrides)} on {host.node()} "
          f"(python {sys.version.split()[0]}); policies {policies}", flush=True)
    plots = False
    if ns.out:
        Path(ns.out).mkdir(parents=True, exist_ok=True)
        try:
            import matplotlib  # noqa: F401

            plots = True
        except ImportError:
            print("# no plots: pip install 'eddyrl[observe]' for matplotlib")
    rows = compare(scenario, overrides, policies,
                   on_done=lambda p, r: print(f"# {p}: {r['wall_s']:.1f} s wall", flush=True),
                   out=ns.out, plots=plots)
    print("# steady steps (all but the first, which fills the pipeline); speedup: trained "
          "samples/s against the faster synchronous baseline run (sync or colocated); "
          "device_idle: over all the cluster's devices", flush=True)
    columns = ["step_s", "tokens_per_s", "samples_per_s", "speedup", "devices", "device_idle",
               "rollout_idle", "train_idle",
               "staleness_mean", "staleness_max", "replay_fraction", "migrated",
               "cpu_per_step_s", "cpu_fraction"]
    print("| policy | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for policy, values in rows.items():
        cells = ["-" if values[c] is None else
                 (f"{values[c]:.3g}" if isinstance(values[c], float) else str(values[c]))
                 for c in columns]
        print(f"| {policy} | " + " | ".join(cells) + " |")
    if ns.out:
        out = Path(ns.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(
            {"scenario": scenario, "overrides": overrides, "policies": rows}, indent=2))
        print(f"# wrote {out / 'results.json'}")
        if plots:
            from .sim.policies import plot

            plot(rows, str(out / "policies.png"), f"{Path(scenario).stem} (simulated)")
            print(f"# wrote {out / 'policies.png'} and a timeline_<policy>.png per policy")
        print(f"# wrote a Perfetto / Chrome trace per policy: {out}/trace_<policy>.json")
    return 0


def _train_epilog() -> str:
    """What `eddy train --help` shows after the arguments: the bundled configs and modes by
    name (read from the package's configs/ folder, nothing imported), and examples."""
    from pathlib import Path

    root = Path(__file__).parent / "configs"

    def names(folder: str) -> str:
        return ", ".join(sorted(p.relative_to(root / folder).with_suffix("").as_posix()
                                for p in (root / folder).rglob("*.yaml")))

    tops = ", ".join(sorted(p.stem for p in root.glob("*.yaml")))
    return f"""\
bundled configs: {tops}; recipes/<name> ({names("recipes")})
modes (bundled, each a file of settings: eddy train modes/<name>):
  {names("modes")}

examples:
  eddy train loop.steps=20 rollout.num_workers=2 run_dir=runs/exp1
  eddy train modes/replay checkpoint.every=10
  eddy train run_dir=runs/exp1 resume=auto      go on from the run's last checkpoint

every key and its value: eddy config show [CONFIG] [KEY=VALUE ...]
  (a mode's settings: eddy config show modes/<name>)
Ctrl-C, SIGTERM or SIGHUP stops a run and says how to resume it (exit status 130 / 143 / 129).
"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eddyrl")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eddy", description="RL post-training of LLMs on "
                                     "GPUs, Ascend NPUs and CPUs.")
    parser.add_argument("--version", action="version", version=f"eddy {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("platforms", help="list known platforms and whether each is usable "
                       "here; `eddy platforms check NAME` runs the platform contract on one")
    p.set_defaults(func=cmd_platforms)  # no sub-command: the list, as before
    platforms_sub = p.add_subparsers(dest="platforms_command", metavar="{check}")
    p = platforms_sub.add_parser("check", help="run the platform contract (HAL hooks, "
                                 "2-process collectives, the engines on the device) on "
                                 "platform NAME; exit status 1 when a check fails",
                                 description="Run the platform contract on platform NAME and "
                                 "print a pass/fail table: exit status 0 when no check failed, "
                                 "1 when one did, 2 when NAME is unknown or not usable here.")
    p.add_argument("name", metavar="NAME", help="a platform name (`eddy platforms` lists them)")
    p.add_argument("--only", nargs="+", action="extend", metavar="CHECK",
                   help="run only these checks or groups (platform, collectives, engines)")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    p.set_defaults(func=cmd_platforms_check)

    p = sub.add_parser("train", help="RL training: [config.yaml | bundled name] "
                       "[key=value ...] (no argument: the bundled tiny model on the CPU; "
                       "bundled names: tool_add_tiny, modes/replay, ...)",
                       usage="eddy train [-h] [CONFIG] [KEY=VALUE ...]",
                       description="RL training as a config says; metrics, checkpoints and a "
                       "summary go to run_dir.", epilog=_train_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="*", metavar="CONFIG KEY=VALUE",
                   help="CONFIG: a YAML file, or the name of a bundled config (no CONFIG: the "
                   "bundled tiny model on the CPU); then any config key as KEY=VALUE")
    p.set_defaults(func=cmd_train)

    add_sft_parser(sub)

    p = sub.add_parser("eval", help="held-out accuracy of a saved model: <checkpoint> "
                       "[config.yaml | bundled name] [key=value ...]")
    p.add_argument("checkpoint")
    p.add_argument("args", nargs="*")
    p.add_argument("--no-verify", action="store_true",
                   help="score a run checkpoint without checking it against its manifest")
    p.add_argument("--show", type=int, default=0, metavar="N",
                   help="also print the first N held-out prompts with the model's response, "
                   "the answer and the reward")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("report", help="PNG plots of a run into <run_dir>/report/: reward and "
                       "held-out accuracy vs time, idle ratio by role, staleness, timeline")
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("sim", help="simulate a cluster run: <scenario> [key=value ...] (a file, "
                       "or a bundled scenario's name: dora_64, libra_48, ...)")
    p.add_argument("args", nargs="*")
    p.add_argument("--trace", default=None,
                   help="write every worker's busy intervals here (Perfetto / Chrome trace)")
    p.set_defaults(func=cmd_sim)

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("sim", help="policies side by side on a simulated scenario: "
                             "<scenario> [key=value ...] --policies a,b,...")
    p.add_argument("args", nargs="*")
    p.add_argument("--policies", default="sync,one_step,partial,async,multiversion,replay,"
                   "bucket,elastic,all,all_elastic")
    p.add_argument("--out", default=None, help="folder for results.json, policies.png and "
                   "each policy's worker timeline (timeline_<policy>.png) and Perfetto / "
                   "Chrome trace (trace_<policy>.json)")
    p.set_defaults(func=cmd_bench_sim)

    p = sub.add_parser("plan", help="predicted memory of a run per role and device, against "
                       "the devices' memory: [config.yaml | bundled name] [key=value ...]; exit "
                       "status 1 when it does not fit",
                       usage="eddy plan [-h] [CONFIG] [KEY=VALUE ...] [--device NAME] [--json]"
                       "\n       eddy plan --cluster SCENARIO [KEY=VALUE ...] [--budget N] "
                       "[--steps N] [--top N] [--json]",
                       description="The memory a run will hold on each device (trainer: "
                       "weights, gradients, optimizer, activations, log-probs, ...; rollout: "
                       "weights, KV cache, workspace) from the model's config.json and the "
                       "run's settings, no weights needed, with the cheapest fixes when it does "
                       "not fit. Exit status 0: fits, 1: does not fit, 2: a bad config. "
                       "With --cluster, the simulator searches mode, split, K, concurrency and "
                       "bucket layout on a scenario instead (docs/config.md).")
    p.add_argument("args", nargs="*", metavar="CONFIG KEY=VALUE",
                   help="CONFIG: a YAML file or a bundled config's name; then KEY=VALUE")
    p.add_argument("--device", metavar="NAME", default=None,
                   help="plan for devices of this datasheet entry (H100, A800, H200, H20, "
                   "910B, ...) instead of this machine's")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--cluster", metavar="SCENARIO", default=None,
                   help="search mode, split, K, concurrency and bucket layout on this simulated "
                   "scenario (a bundled name: dora_64, reflow_8, ...; or a file); KEY=VALUE "
                   "then override the scenario")
    p.add_argument("--budget", metavar="N", type=int, default=24,
                   help="--cluster: simulated runs in all, at least one per registry mode "
                   "(default 24)")
    p.add_argument("--steps", metavar="N", type=int, default=3,
                   help="--cluster: steps per simulated run; the first fills the pipeline "
                   "and is left out of the comparison (default 3)")
    p.add_argument("--top", metavar="N", type=int, default=5,
                   help="--cluster: how many of the best to print (default 5)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("config", help="inspect configuration")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    p = config_sub.add_parser("show", help="print the resolved config: "
                              "[file.yaml | bundled name] [key=value ...]")
    p.add_argument("args", nargs="*")
    p.add_argument("--diff", action="store_true",
                   help="only the keys whose values differ from the defaults")
    p.set_defaults(func=cmd_config_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    # argparse takes positionals only before the first option: key=value overrides written
    # after one (`eddy bench sim dora_64 --policies sync loop.steps=4`) join the others
    if extra and hasattr(ns, "args") and all("=" in a and not a.startswith("-") for a in extra):
        ns.args = [*ns.args, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return ns.func(ns)
    except EddyError as exc:
        print(f"eddy: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a command other than train (which says where it stopped)
        print("eddy: stopped (SIGINT)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
