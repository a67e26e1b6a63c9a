"""The cheapest changes that make a plan fit, in order, each applied on top of the ones before
and kept only if it lowers the predicted peak: for the trainer, checkpointing (selective, then
full), one sequence per micro-batch, chunked log-probs, bf16 compute, offload (optimizer, then
everything), then more ranks; for a rollout engine, bf16 weights and KV cache, then fewer
sequences per worker (its exact KV cache is sized by them) or, when the KV cache is a share of
the device (`rollout.memory_fraction`), the largest share that fits. Each is a `key=value` the
command line takes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from ..config import EddyConfig
    from .memory_plan import DevicePlan, Fix

MAX_RANK_DOUBLINGS = 6  # up to 64x the ranks before giving up
# A change is a fix when it lowers the role's peak by at least this share (more ranks past
# the point where the sharded state is small change next to nothing)
LEAST_GAIN = 0.02


def over_roles(devices: tuple[DevicePlan, ...]) -> set[str]:
    """The roles whose memory puts a device over: both on a shared host, the larger ones on a
    colocated device; and a role that cannot start as configured (`RolePlan.refused`)."""
    over: set[str] = set()
    for device in devices:
        if device.fits:
            continue
        limit = device.memory.bytes - device.reserve
        refused = {r.role for r in device.roles if r.refused}
        if refused and device.margin >= device.reserve:
            over |= refused  # room enough; a role cannot start as configured
        elif device.sharing == "turns":
            over |= {r.role for r in device.roles if r.peak > limit} | refused
        else:
            over |= {r.role for r in device.roles}
    return over


def role_peak(devices: tuple[DevicePlan, ...], role: str) -> int:
    """The largest peak of one process of `role` over the devices."""
    return max(r.peak for d in devices for r in d.roles if r.role == role)


def _train_steps(config: EddyConfig, on_host: bool) -> Iterator[tuple[str, object, str]]:
    """The trainer's candidates for `config` as it stands now (one at a time: each depends on
    the ones already taken). `on_host`: the device is the host's memory, which offload and
    more ranks (processes) do not relieve."""
    from .memory_plan import longest_sequence, training_options

    train = config.train
    if train.activation_checkpointing == "none":
        yield ("train.activation_checkpointing", "selective",
               "recompute each decoder layer in the backward, but its attention")
    if train.activation_checkpointing != "full":
        yield ("train.activation_checkpointing", "full",
               "keep only each decoder layer's input; recompute the rest in the backward")
    longest = longest_sequence(config)
    if training_options(config, "mask").tokens_per_micro_batch > longest:
        yield ("train.max_tokens_per_micro_batch", longest,
               "one longest sequence per micro-batch")
    if train.logprob_chunk_tokens == 0 or train.logprob_chunk_tokens > 1024:
        yield ("train.logprob_chunk_tokens", 1024,
               "log-probs through the LM head in chunks, never [tokens, vocab] at once")
    if train.param_dtype == "fp32":
        yield ("train.param_dtype", "bf16",
               "bf16 compute (weights gathered and activations in bf16; fp32 master weights)")
    if on_host:
        return
    if train.offload == "none":
        yield ("train.offload", "optimizer", "optimizer state and gradients in host memory")
    if train.offload != "all":
        yield ("train.offload", "all", "parameters in host memory too")
    yield ("train.num_workers", train.num_workers * 2, "shard the state over twice the ranks")


def _rollout_steps(config: EddyConfig, devices_of) -> Iterator[tuple[str, object, str]]:
    """The rollout engine's candidates for `config` as it stands now (one at a time)."""
    rollout = config.rollout
    if rollout.dtype == "fp32":
        yield ("rollout.dtype", "bf16",
               "rollout weights and KV cache in bf16: half the bytes of each")
    found = _rollout_fraction(config, devices_of) if rollout.memory_fraction \
        else _rollout_batch(config, devices_of)
    if found is not None:
        yield found


# `rollout.memory_fraction`s tried, largest first (more KV for the batch)
FRACTIONS = tuple(round(0.95 - 0.05 * i, 2) for i in range(19))


def _rollout_fraction(config: EddyConfig, devices_of) -> tuple[str, object, str] | None:
    """The largest `rollout.memory_fraction` (in steps of 0.05) with which the engine fits
    and starts, if another than the current one does."""
    from .memory_plan import with_setting

    for fraction in FRACTIONS:
        if fraction == config.rollout.memory_fraction:
            continue
        trial = devices_of(with_setting(config, "rollout.memory_fraction", fraction))
        if "rollout" not in over_roles(trial):
            return ("rollout.memory_fraction", fraction,
                    "the engine's share of the device: room for its weights and workspace, "
                    "at least one longest sequence of KV cache, and the memory kept free")
    return None


def _rollout_batch(config: EddyConfig, devices_of) -> tuple[str, object, str] | None:
    """The largest `rollout.max_batch_size` below the current one that fits, else 1."""
    from .memory_plan import with_setting

    low, high = 1, config.rollout.max_batch_size - 1
    if high < 1:
        return None
    best = 1
    while low <= high:
        middle = (low + high) // 2
        trial = devices_of(with_setting(config, "rollout.max_batch_size", middle))
        if "rollout" in over_roles(trial):
            high = middle - 1
        else:
            best, low = middle, middle + 1
    return ("rollout.max_batch_size", best,
            "fewer sequences per rollout worker: its KV cache is sized for them")


def find_fixes(config: EddyConfig,
               devices_of: Callable[[EddyConfig], tuple[DevicePlan, ...]]) -> list[Fix]:
    from .memory_plan import Fix, with_setting

    fixes: list[Fix] = []
    devices = devices_of(config)
    doublings = 0
    while not all(d.fits for d in devices):
        over = over_roles(devices)
        step = None
        if "train" in over:
            on_host = any(d.memory.host for d in devices)
            for key, value, why in _train_steps(config, on_host):
                if key == "train.num_workers":
                    if doublings >= MAX_RANK_DOUBLINGS:
                        break
                    doublings += 1
                trial = devices_of(with_setting(config, key, value))
                if role_peak(trial, "train") < (1 - LEAST_GAIN) * role_peak(devices, "train"):
                    step = ("train", key, value, why, trial)
                    break
        if step is None and "rollout" in over:
            for key, value, why in _rollout_steps(config, devices_of):
                trial = devices_of(with_setting(config, key, value))
                if "rollout" not in over_roles(trial) or role_peak(trial, "rollout") < (
                        1 - LEAST_GAIN) * role_peak(devices, "rollout"):
                    step = ("rollout", key, value, why, trial)
                    break
        if step is None:
            break  # nothing cheaper left: the plan says what remains over
        role, key, value, why, devices = step
        config = with_setting(config, key, value)
        fixes.append(Fix(f"{key}={value}", why, role, role_peak(devices, role),
                         all(d.fits for d in devices)))
    return fixes
