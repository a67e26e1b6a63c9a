"""Failure injection for the simulator: what device failures cost a run over days of virtual
time, with a lost trainer device recovered in place (issue 37's design) or by a restart from
the last checkpoint (what Eddy does today). Sans-IO: a seeded Monte Carlo over the step times a
simulated run measured (`ClusterTiming.of`); no clock, no I/O.

The failure rate is published: Meta's "The Llama 3 Herd of Models" (arXiv 2407.21783, 2024),
section 3.3.4 (Reliability and Operational Challenges), counts 466 job interruptions in a
54-day snapshot of pre-training on 16,384 H100 GPUs, 47 planned and 419 unexpected, about 78 %
of the unexpected ones attributed to confirmed or suspected hardware. Taking every unexpected
interruption as one device's failure:

    419 / (16,384 GPUs x 54 days x 24 h) = 419 / 21,233,664 device-hours
                                         = 1.97e-5 failures per device-hour
    (hardware only: 0.78 x 419 = 327 -> 1.54e-5)

so a 1,024-device cluster sees 1.97e-5 x 1,024 x 24 = 0.49 failures a day. Failures arrive as
one Poisson process per role (trainer devices, rollout devices) at that rate times the role's
devices; both recoveries see the same failure times (one seeded stream per role).

What a failure costs (`RecoveryCosts`): a rollout device lost takes its engine instance out
(Eddy today: the worker replaced, its requests regenerated on the survivors); a trainer device
lost either ends the job (restart: relaunch, the last checkpoint loaded, the pipeline refilled,
every step since the checkpoint redone) or is recovered in place (detect, a replacement rank
and a new process group, the lost shard from a buddy copy in a peer's host memory, the
interrupted step's training rerun). Every time without a source is a labelled assumption in
`FailureSettings`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence, get_args

from ..validation import check_choice, check_range

# The Llama 3 Herd of Models (arXiv 2407.21783), section 3.3.4: the 54-day snapshot
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
LLAMA3_HARDWARE_SHARE = 0.78  # "about 78%" of the unexpected: confirmed or suspected hardware
# The same paper, section 3.3.1 (storage): Tectonic sustains 2 TB/s for the 16K-GPU job; a
# device's share of it is what a job of N devices is given here (N x 122 MB/s)
LLAMA3_STORAGE_SUSTAINED_BPS = 2e12
STORAGE_SHARE_PER_DEVICE = LLAMA3_STORAGE_SUSTAINED_BPS / LLAMA3_GPUS

# What a checkpoint holds per parameter: Eddy's FSDP trainer keeps fp32 weights (4 bytes) and
# AdamW's two fp32 moments (4 + 4); gradients are not saved
CHECKPOINT_BYTES_PER_PARAM = 12

Recovery = Literal["in_place", "restart"]
HOUR_S = 3600.0
DAY_S = 24 * HOUR_S


def llama3_rate_per_device_hour(hardware_only: bool = False) -> float:
    """Failures per device-hour from the Llama 3 snapshot (module docstring's arithmetic)."""
    failures = LLAMA3_UNEXPECTED_INTERRUPTIONS * (LLAMA3_HARDWARE_SHARE if hardware_only
                                                  else 1.0)
    return failures / (LLAMA3_GPUS * LLAMA3_DAYS * 24)


@dataclass(kw_only=True, slots=True)
class FailureSettings:
    """The failure model's settings. Defaults marked *assumption* are not measured here; each
    bench run prints them beside its table."""

    rate_per_device_hour: float = llama3_rate_per_device_hour()
    # seconds from a device's fault to the controller acting on it, the same for both
    # recoveries (*assumption*: issue 37's target, "within seconds", plus Ray's health checks;
    # a hung collective without it waits the HAL's process-group timeout, 600 s)
    detect_s: float = 30.0
    # in place: a replacement trainer rank started and a new process group formed over TCP
    # (*assumption*)
    reform_s: float = 60.0
    # restart: the job relaunched (scheduler, Ray, every worker process) before it loads any
    # state (*assumption*)
    relaunch_s: float = 300.0
    # a rollout worker's replacement process and engine start, before its weights load
    # (*assumption*)
    engine_start_s: float = 120.0
    # the share of the buddy copy (a rank's shard to its host memory after every optimizer
    # step) that the step waits for: 1 charges all of it (a lower bound on in-place goodput),
    # 0 none (the copy fully overlapped with the next step)
    buddy_exposed: float = 1.0
    # checkpoint storage per device of the job (default: Llama 3's share, above)
    storage_bps_per_device: float = STORAGE_SHARE_PER_DEVICE
    checkpoint_every: int = 10  # steps between checkpoints (`checkpoint.every`)
    horizon_days: float = 7.0  # virtual time the Monte Carlo runs
    seed: int = 0

    def validate(self, prefix: str = "failures") -> None:
        check_range(f"{prefix}.rate_per_device_hour", self.rate_per_device_hour, 0)
        for name in ("detect_s", "reform_s", "relaunch_s", "engine_start_s"):
            check_range(f"{prefix}.{name}", getattr(self, name), 0)
        check_range(f"{prefix}.buddy_exposed", self.buddy_exposed, 0, 1)
        check_range(f"{prefix}.storage_bps_per_device", self.storage_bps_per_device, 0,
                    lo_open=True)
        check_range(f"{prefix}.checkpoint_every", self.checkpoint_every, 1)
        check_range(f"{prefix}.horizon_days", self.horizon_days, 0, lo_open=True)


@dataclass(frozen=True, slots=True)
class ClusterTiming:
    """A scenario's steps and cluster, as its simulated run measured them."""

    step_s: float  # a steady step
    train_s: float  # the trainer's phase at a step's end (training and the weight sync)
    refill_s: float  # the first step's extra time: the pipeline filled from empty
    train_devices: int
    rollout_devices: int
    rollout_instances: int
    params: int  # the model's parameters
    weights_bytes: int  # the model in the engines' dtype
    host_link_bps: float  # a device's link to its host memory (the buddy copy's path)

    @classmethod
    def of(cls, config: Any, summary: Mapping[str, Any]) -> ClusterTiming:
        """From a `sim.runtime.simulate` run of `config` (two steps at least: the first fills
        the pipeline, the rest are steady)."""
        from ..scheduler.hardware import lookup_model

        steps = [m for m in summary["history"] if m.get("step", 0) > 0]
        if len(steps) < 2:
            raise ValueError(f"a run of {len(steps)} step(s): the steady step needs two")
        steady = steps[1:]
        step_s = sum(m["step_s"] for m in steady) / len(steady)
        train_s = sum(m["train_s"] + m["sync_s"] for m in steady) / len(steady)
        sim = config.sim
        model = lookup_model(sim.model)
        return cls(step_s=step_s, train_s=min(train_s, step_s),
                   refill_s=max(steps[0]["step_s"] - step_s, 0.0),
                   train_devices=sim.train.devices, rollout_devices=sim.rollout.devices,
                   rollout_instances=summary["rollout_instances"],
                   params=model.total_params, weights_bytes=model.total_params * 2,
                   host_link_bps=sim.host_link_bandwidth)

    @property
    def devices(self) -> int:
        return self.train_devices + self.rollout_devices


@dataclass(frozen=True, slots=True)
class RecoveryCosts:
    """Seconds each event costs, from a cluster's timing and the settings."""

    checkpoint_save_s: float  # every `checkpoint_every` steps, the trainer stopped
    restart_down_s: float  # detect + relaunch + state loaded + pipeline refilled
    in_place_down_s: float  # detect + reform + the lost shard restored from its buddy
    buddy_copy_s: float  # what each step waits for of its buddy copy, under in-place recovery
    rollout_lost_s: float  # a lost rollout instance, in the whole cluster's time

    @classmethod
    def of(cls, timing: ClusterTiming, settings: FailureSettings) -> RecoveryCosts:
        """Storage: the job's bandwidth is its devices' shares together; a checkpoint save
        writes the trainer's state at it, a restart reads the state back and every engine's
        weights at it; a lone replacement engine reads at its own devices' shares. The buddy
        copy of a rank's shard crosses its host link after every optimizer step; the step
        waits for `buddy_exposed` of it (issue 37's buddy replication overlaps that copy where
        the platform can and sends it on to the buddy off the critical path). The lost shard
        comes back over the same link. A lost rollout instance is
        charged as the fraction of the rollout it was, for its replacement time plus half a
        step of in-flight work regenerated: an upper bound, exact only when the rollout is the
        bottleneck."""
        checkpoint = timing.params * CHECKPOINT_BYTES_PER_PARAM
        rank_shard = checkpoint / timing.train_devices
        job_bps = settings.storage_bps_per_device * timing.devices
        save_s = checkpoint / job_bps
        load_s = (checkpoint + timing.rollout_instances * timing.weights_bytes) / job_bps
        restart = settings.detect_s + settings.relaunch_s + load_s + timing.refill_s
        tp = timing.rollout_devices / timing.rollout_instances
        engine_load_s = timing.weights_bytes / (tp * settings.storage_bps_per_device)
        copy_s = rank_shard / timing.host_link_bps
        in_place = settings.detect_s + settings.reform_s + copy_s
        replace_s = settings.detect_s + settings.engine_start_s + engine_load_s
        rollout_lost = (replace_s + timing.step_s / 2) / timing.rollout_instances
        return cls(checkpoint_save_s=save_s, restart_down_s=restart, in_place_down_s=in_place,
                   buddy_copy_s=copy_s * settings.buddy_exposed,
                   rollout_lost_s=rollout_lost)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One Monte Carlo run: useful steps' time over wall time, and what failed."""

    recovery: Recovery
    goodput: float
    steps: int  # steps that count (never redone)
    wall_s: float  # the horizon, and the step running at its end finished
    train_failures: int  # over the horizon
    rollout_failures: int
    lost_s: float  # wall time not spent on useful steps
    horizon_s: float

    @property
    def failures_per_day(self) -> float:
        return (self.train_failures + self.rollout_failures) / (self.horizon_s / DAY_S)


def failure_times(rate_per_s: float, horizon_s: float, rng: random.Random) -> list[float]:
    """A Poisson process's arrival times in [0, horizon_s)."""
    times, t = [], 0.0
    if rate_per_s <= 0:
        return times
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= horizon_s:
            return times
        times.append(t)


def failure_events(timing: ClusterTiming, settings: FailureSettings
                   ) -> list[tuple[float, str]]:
    """(time, role) of every failure over the horizon; one seeded stream per role, so both
    recoveries see the same failures."""
    horizon = settings.horizon_days * DAY_S
    per_s = settings.rate_per_device_hour / HOUR_S
    events = [(t, role) for role, devices in (("train", timing.train_devices),
                                              ("rollout", timing.rollout_devices))
              for t in failure_times(per_s * devices, horizon,
                                     random.Random(f"{settings.seed}:{role}"))]
    return sorted(events)


def run(timing: ClusterTiming, settings: FailureSettings, recovery: Recovery,
        events: Sequence[tuple[float, str]] | None = None) -> Outcome:
    """Steps back to back over the horizon, each followed every `checkpoint_every` steps by a
    checkpoint save, through the failure `events` ((time, "train" | "rollout"), sorted;
    default: drawn from the settings' seed). A trainer failure while the job recovers starts
    the recovery over; a rollout failure then costs nothing more (simplified: under in-place
    recovery the rollout goes on meanwhile and could lose work)."""
    settings.validate()
    check_choice("recovery", recovery, get_args(Recovery))
    costs = RecoveryCosts.of(timing, settings)
    copy_s = costs.buddy_copy_s if recovery == "in_place" else 0.0
    rollout_phase = timing.step_s - timing.train_s  # the trainer's phase ends the step

    def work(step: int) -> float:
        save = costs.checkpoint_save_s if step % settings.checkpoint_every == 0 else 0.0
        return timing.step_s + copy_s + save

    horizon = settings.horizon_days * DAY_S
    events = failure_events(timing, settings) if events is None else list(events)
    t, done, saved = 0.0, 0, 0
    left, elapsed = work(1), 0.0
    i = 0
    while t < horizon:
        f, role = events[i] if i < len(events) else (math.inf, "")
        if f >= t + left:  # the step finishes first
            t += left
            done += 1
            if done % settings.checkpoint_every == 0:
                saved = done
            left, elapsed = work(done + 1), 0.0
            continue
        i += 1
        if f < t:  # during a recovery, or a lost rollout instance's charge
            if role == "train" and recovery == "in_place":
                t = max(t, f + costs.in_place_down_s)
            elif role == "train":
                t = max(t, f + costs.restart_down_s)
                done = saved
                left, elapsed = work(done + 1), 0.0
            continue
        elapsed, left, t = elapsed + (f - t), left - (f - t), f
        if role == "rollout":
            t += costs.rollout_lost_s
        elif recovery == "in_place":
            rerun = min(max(elapsed - rollout_phase, 0.0), timing.train_s)
            t += costs.in_place_down_s
            left, elapsed = left + rerun, elapsed - rerun
        else:
            t += costs.restart_down_s
            done = saved
            left, elapsed = work(done + 1), 0.0
    useful = done * timing.step_s
    trained = sum(role == "train" for _, role in events)
    return Outcome(recovery=recovery, goodput=useful / t, steps=done, wall_s=t,
                   train_failures=trained, rollout_failures=len(events) - trained,
                   lost_s=t - useful, horizon_s=horizon)


# -- analytic expectations, for checking the Monte Carlo ---------------------------------------

def failures_per_day(timing: ClusterTiming, settings: FailureSettings) -> dict[str, float]:
    """Expected failures a day per role: rate x devices x 24 h."""
    day = settings.rate_per_device_hour * 24
    return {"train": day * timing.train_devices, "rollout": day * timing.rollout_devices}


def _rates(timing: ClusterTiming, settings: FailureSettings) -> tuple[float, float]:
    per_s = settings.rate_per_device_hour / HOUR_S
    return per_s * timing.train_devices, per_s * timing.rollout_devices


def _retried(rate: float, seconds: float) -> float:
    """Expected wall time to get `seconds` done when a failure at `rate` starts it over:
    (exp(r s) - 1) / r."""
    return math.expm1(rate * seconds) / rate if rate else seconds


def loss_per_train_failure(timing: ClusterTiming, settings: FailureSettings
                           ) -> dict[str, float]:
    """Expected seconds one trainer failure costs. In place: its downtime and the training
    rerun (in_place_goodput's terms). Restart: its downtime and the work done since the
    checkpoint interval L began, which for failures at rate r within an attempt is

        1 / r - L / (exp(r L) - 1)   (-> L / 2, half an interval, as r -> 0)."""
    costs = RecoveryCosts.of(timing, settings)
    r, _ = _rates(timing, settings)
    interval = settings.checkpoint_every * timing.step_s + costs.checkpoint_save_s
    lost_work = 1 / r - interval / math.expm1(r * interval) if r else interval / 2
    return {"in_place": costs.in_place_down_s + _mean_rerun(timing, settings, costs),
            "restart": costs.restart_down_s + lost_work}


def _in_place_interval(timing: ClusterTiming, settings: FailureSettings,
                       costs: RecoveryCosts) -> float:
    """A checkpoint interval's work under in-place recovery: steps, buddy copies, the save."""
    return (settings.checkpoint_every * (timing.step_s + costs.buddy_copy_s)
            + costs.checkpoint_save_s)


def _mean_rerun(timing: ClusterTiming, settings: FailureSettings,
                costs: RecoveryCosts) -> float:
    """The training an in-place recovery reruns, for a failure uniform over an interval's work:
    the trainer's phase ends each step, then the copy (and the save) with all of it done:
    (every x (train^2 / 2 + train x copy) + train x save) / interval."""
    train = timing.train_s
    return ((settings.checkpoint_every * (train ** 2 / 2 + train * costs.buddy_copy_s)
             + train * costs.checkpoint_save_s) / _in_place_interval(timing, settings, costs))


def restart_goodput(timing: ClusterTiming, settings: FailureSettings) -> float:
    """Goodput under restart. A checkpoint interval is L = every x step + save of work; trainer
    failures at rate r each cost the work since the interval began and a downtime D that a
    failure during it starts over, so the working time per interval done is
    (exp(r L) - 1) / r, and each of its exp(r L) - 1 failures adds (exp(r D) - 1) / r:

        E[T] = (exp(r L) - 1) / r x (exp(r D) + r_rollout x rollout charge)

    (the classic result for work that restarts on failure; rollout failures, at r_rollout,
    charge their cost while the job works, to first order). goodput = every x step / E[T]."""
    costs = RecoveryCosts.of(timing, settings)
    r, r_rollout = _rates(timing, settings)
    interval = settings.checkpoint_every * timing.step_s + costs.checkpoint_save_s
    working = _retried(r, interval)
    expected = working * (math.exp(r * costs.restart_down_s)
                          + r_rollout * costs.rollout_lost_s)
    return settings.checkpoint_every * timing.step_s / expected


def in_place_goodput(timing: ClusterTiming, settings: FailureSettings) -> float:
    """Goodput under in-place recovery, to first order in the failure rate. Per second of
    work, trainer failures (rate r) each add a downtime, started over by a failure during it
    ((exp(r D) - 1) / r), and rerun the training done so far (`_mean_rerun`); rollout
    failures add their charge. goodput = useful work / interval x (1 - r x rerun) /
    (1 + lost per s)."""
    costs = RecoveryCosts.of(timing, settings)
    r, r_rollout = _rates(timing, settings)
    interval = _in_place_interval(timing, settings, costs)
    lost_per_s = r * _retried(r, costs.in_place_down_s) + r_rollout * costs.rollout_lost_s
    return (settings.checkpoint_every * timing.step_s / interval
            * (1 - r * _mean_rerun(timing, settings, costs)) / (1 + lost_per_s))
