"""`eddy`: the command line. This module holds the parser (every sub-command's arguments and
help) and the dispatch; each sub-command's handler is a thin shell over a library function,
in the module named after it: cli_train.py (train, eval, report), cli_sft.py (sft, with its
own flags), cli_sim.py (sim, bench sim), cli_plan.py, cli_platforms.py, cli_config.py (config
show, and the `[CONFIG] [KEY=VALUE ...]` arguments). Every heavy import is inside a handler:
`eddy --help` loads none."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .cli_config import cmd_config_show
from .cli_plan import cmd_plan
from .cli_platforms import cmd_platforms, cmd_platforms_check
from .cli_sft import add_sft_parser
from .cli_sim import cmd_bench_sim, cmd_sim
from .cli_train import cmd_eval, cmd_report, cmd_train
from .errors import EddyError


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
