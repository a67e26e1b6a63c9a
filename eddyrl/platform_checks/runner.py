"""The checks by name, and running them against one platform with each check isolated: an
exception in one is that check's failure and never stops the others."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Literal

from ..errors import EddyError
from ..hal import Platform, get_platform
from ..hal import distributed as hd
from . import collectives, contract, engines, varlen
from .common import CheckSkipped

GROUPS = ("platform", "collectives", "engines")
Status = Literal["passed", "failed", "skipped"]


class UnknownCheck(EddyError, ValueError):
    """`--only` named a check or group that does not exist."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    group: str
    function: Callable[[Platform], str | None]

    @property
    def summary(self) -> str:
        """The first paragraph of the function's docstring: what it checks."""
        paragraph = (self.function.__doc__ or "").strip().split("\n\n")[0]
        return " ".join(paragraph.split())

    def __call__(self, platform: Platform) -> str | None:
        return self.function(platform)


@dataclass(slots=True)
class CheckResult:
    name: str
    group: str
    status: Status
    seconds: float
    detail: str = ""  # passed: what it saw; failed: "Type: message"; skipped: why
    traceback: str = ""  # failed only: where it was raised (in --json, not in the table)

    def as_dict(self) -> dict:
        return asdict(self)


def _registry(*checks: tuple[str, str, Callable]) -> dict[str, Check]:
    return {name: Check(name, group, function) for name, group, function in checks}


CHECKS: dict[str, Check] = _registry(
    ("identity", "platform", contract.check_identity),
    ("tensors", "platform", contract.check_tensors),
    ("streams_events", "platform", contract.check_streams_events),
    ("memory", "platform", contract.check_memory),
    ("rng", "platform", contract.check_rng),
    ("autocast", "platform", contract.check_autocast),
    ("profile_patches", "platform", contract.check_profile_patches),
    ("host_weight_channel", "platform", contract.check_host_weight_channel),
    ("ray_resources", "platform", contract.check_ray_resources),
    ("sleep_wake", "platform", contract.check_sleep_wake),
    ("collective_ops", "collectives", collectives.check_collectives),
    ("collective_weight_channel", "collectives", collectives.check_collective_weight_channel),
    ("hf_generate", "engines", engines.check_hf_generate),
    ("hf_abort", "engines", engines.check_hf_abort),
    ("hf_sleep_wake", "engines", engines.check_hf_sleep_wake),
    ("fsdp_train_step", "engines", engines.check_fsdp_train_step),
    ("fsdp_weights_to_hf", "engines", engines.check_fsdp_weights_to_hf),
    ("varlen_attention", "engines", varlen.check_varlen_attention),
)


# Check names and group names are one namespace (`--only` takes either).
assert not set(CHECKS) & set(GROUPS), "a check is named like a group"


def names_in(group: str) -> list[str]:
    return [name for name, check in CHECKS.items() if check.group == group]


def select(only: Iterable[str] | None = None) -> list[Check]:
    """The checks `only` names (check or group names), in registry order; all when None."""
    if not only:
        return list(CHECKS.values())
    wanted = set()
    for name in only:
        if name in CHECKS:
            wanted.add(name)
        elif name in GROUPS:
            wanted.update(names_in(name))
        else:
            raise UnknownCheck(f"unknown check {name!r}; checks: {', '.join(CHECKS)}; groups: "
                               f"{', '.join(GROUPS)}")
    return [check for name, check in CHECKS.items() if name in wanted]


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _failure(exc: Exception) -> str:
    message = _one_line(str(exc))
    if not message:  # a bare `assert` (a plug-in's own check): name the line that failed
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        message = f"{frame.line} ({os.path.basename(frame.filename)}:{frame.lineno})"
    return f"{type(exc).__name__}: {message}"


def run_check(check: Check, platform: Platform) -> CheckResult:
    had_group = hd.is_initialized()  # the caller's own, if any: left alone
    started = time.perf_counter()
    try:
        detail = check(platform)
        status, trace = "passed", ""
    except CheckSkipped as skip:
        status, detail, trace = "skipped", _one_line(str(skip)), ""
    except Exception as exc:  # the check's failure, whatever the platform's code raised
        status, detail, trace = "failed", _failure(exc), traceback.format_exc()
    finally:
        # A check that failed half way may leave the default process group joined (the
        # trainer's); the next one would then take it for a runtime's and never form its own.
        if not had_group and hd.is_initialized():
            hd.destroy()
    return CheckResult(check.name, check.group, status, time.perf_counter() - started,
                       detail or "", trace)


def run_checks(platform_name: str, only: Iterable[str] | None = None, *,
               on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Run the selected checks against the platform called `platform_name`. An unknown or
    unusable platform, or an unknown check, is one `EddyError` naming it, before any check
    runs. `on_result` sees each result as it comes (progress for a long run)."""
    checks = select(only)
    platform = get_platform(platform_name)
    results = []
    for check in checks:
        result = run_check(check, platform)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results
