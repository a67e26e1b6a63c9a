"""The controller's side of a run checkpoint: everything the loop needs to go on exactly where
it stopped, taken at a step boundary and written without pickle.

Kept: the version and version window, the replay buffer (its groups with token ids, log-probs,
versions, rewards and, with routing replay, routed experts: tensors in safetensors, the rest
JSON), the ledger, the data position (epoch, prompts drawn from its permutation, prompts
drawn and not yet handed out), the group id counter, the reward-error count, the step
metrics so far, this process's RNG state, and the stability governor's K and calm count (when
it is on).

Not kept, on purpose: groups still generating, or collected and not yet trained, at the
checkpoint. Their output is not saved; a resume puts them back in the queue under their own
ids (`Ledger.requeue_lost`) to be generated again on the restored policy before any new
prompt, so none is lost and none is trained twice as fresh. Also not kept (they restart): the
bucket router's and adaptive scheduler's learned statistics, the elastic pool (every worker
starts in rollout), and the environments' counters.

`capture` does not await, so no generation result can change the state while it is taken.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from array import array

from ..protocol import GenerationResult, Group, RoutedExperts, Trajectory
from ..errors import ConfigError
from .ledger import State

# In a checkpoint beside the trainer's files: a directory of their own (the checkpoint's root is
# an HF model directory, whose *.safetensors are the weights), and the ledger at the top, where
# it has always been
STATE_DIR = "run_state"
STATE_FILE = f"{STATE_DIR}/state.json"
TENSOR_FILE = f"{STATE_DIR}/tensors.safetensors"
LEDGER_FILE = "ledger.json"
FORMAT = 1
# GenerationResult's per-token lists, stored as flat tensors; every other field goes to JSON
_RAGGED = {"prompt_ids": torch.int64, "token_ids": torch.int64, "logprobs": torch.float64,
           "versions": torch.int64, "loss_mask": torch.int64}
# rollout routing replay's experts (RoutedExperts): their ids flat in one int16 tensor, their
# shape and width in JSON beside the result's other fields
_EXPERTS = "routed_experts"
_UNFINISHED = (State.QUEUED, State.GENERATING, State.COLLECTED)


@dataclass
class RunState:
    meta: dict[str, Any]  # JSON
    ledger: dict[str, Any]  # Ledger.to_dict()
    tensors: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return self.meta["step"]


def capture(controller) -> RunState:
    """The controller's state now, between two steps."""
    replay = controller.replay.state()
    groups, tensors = _pack_groups([entry["group"] for entry in replay["entries"]])
    replay["entries"] = [{**entry, "group": group}
                         for entry, group in zip(replay["entries"], groups)]
    version, internal, gauss = random.getstate()
    tensors["rng.torch"] = torch.get_rng_state()
    loop = controller.state()
    meta = {"format": FORMAT, "step": controller.history[-1]["step"],
            "seed": controller.settings.seed,
            "data": {"fingerprint": controller.train_prompts.fingerprint,
                     **controller.prompt_queue.state()},
            "window": controller.window.state(), "replay": replay,
            "next_group_id": loop["next_group_id"],
            **({"governor": loop["governor"]} if "governor" in loop else {}),  # its K
            "reward_errors": controller.reward.errors, "history": list(controller.history),
            "rng": {"python": [version, list(internal), gauss]},
            "platforms": dict(controller.settings.platforms)}
    return RunState(meta, controller.ledger.to_dict(), tensors)


def write(directory: Path, state: RunState) -> None:
    directory = Path(directory)
    (directory / STATE_DIR).mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in state.tensors.items()},
              directory / TENSOR_FILE)
    (directory / LEDGER_FILE).write_text(json.dumps(state.ledger))
    (directory / STATE_FILE).write_text(json.dumps(state.meta))


def read(directory: Path) -> RunState:
    """The run state of the checkpoint at `directory`, its structure checked: a file that does
    not parse, lacks a key or holds the wrong kind of value is a `CheckpointError` naming the
    file (a resume then falls back to an earlier checkpoint)."""
    from ..checkpoints import CheckpointError

    directory = Path(directory)
    where = f"checkpoint '{directory}'"
    meta, ledger = (_read_json(where, directory, name) for name in (STATE_FILE, LEDGER_FILE))
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise ConfigError(f"'{directory}': run state format {found!r}, this version of Eddy "
                          f"reads format {FORMAT}")
    _check_shape(where, STATE_FILE, meta, _META_SHAPE)
    if "governor" in meta:  # written only with window.governor on
        _check_shape(where, f"{STATE_FILE}'s governor", meta["governor"], {"k": int, "calm": int})
        if "scale" in meta["governor"]:  # the correction bounds' scale (older: none, 1)
            _check_shape(where, f"{STATE_FILE}'s governor", meta["governor"],
                         {"scale": (int, float)})
    _check_shape(where, LEDGER_FILE, ledger, {"step": int, "groups": dict})
    try:
        from .ledger import Ledger

        Ledger.from_dict(ledger)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {LEDGER_FILE} is not a valid ledger "
                              f"({type(exc).__name__}: {exc})") from None
    try:
        tensors = load_file(directory / TENSOR_FILE)
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{where}: {TENSOR_FILE} cannot be read ({exc})") from None
    return RunState(meta, ledger, tensors)


# The top-level keys of state.json a resume reads, and their kinds
_META_SHAPE = {"step": int, "seed": int, "data": dict, "window": dict, "replay": dict,
               "next_group_id": int, "reward_errors": int, "history": list, "rng": dict}


def _check_shape(where: str, name: str, data: Any, shape: dict[str, type]) -> None:
    from ..checkpoints import CheckpointError

    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: {name} holds a {type(data).__name__}, not an object")
    for key, kind in shape.items():
        if key not in data:
            raise CheckpointError(f"{where}: {name} has no {key!r}")
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise CheckpointError(f"{where}: {name}: {key!r} = {data[key]!r} is not "
                                  f"a{'n' if kind is int else ''} {kind.__name__}")


def _read_json(where: str, directory: Path, name: str) -> Any:
    from ..checkpoints import CheckpointError

    try:
        return json.loads((directory / name).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{where} has no {name}: it is not a run checkpoint of "
                              "`eddy train`") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: {name} is not valid JSON ({exc})") from None


def check_seed(state: RunState, seed: int) -> None:
    """The prompt order is the seed's: another seed's data position means nothing."""
    if state.meta["seed"] != seed:
        raise ConfigError(f"config key 'seed' = {seed} but the checkpoint was written with "
                          f"seed = {state.meta['seed']}; the prompt order depends on it, so "
                          "resume with the same seed")


def check_platforms(state: RunState, platforms: dict[str, str],
                    explicit: dict[str, bool]) -> None:
    """A resume on other devices than the checkpoint's only when the user names the platform
    (`platform=...` or `<role>.platform=...`): `auto` or an `EDDY_PLATFORM` set on one machine
    and not on the other must not switch a run's devices silently. Checkpoints written before
    platforms were recorded carry none and pass."""
    recorded = state.meta.get("platforms") or {}
    for role, name in platforms.items():
        before = recorded.get(role)
        if before is None or before == name or explicit.get(role):
            continue
        raise ConfigError(
            f"the checkpoint was written with the {role} role on platform {before!r}, and this "
            f"run resolved {name!r} (platform=auto: EDDY_PLATFORM, else detection); resume on "
            f"{before!r}, or name the new platform to move the run ({role}.platform={name} or "
            f"platform={name})")


def check_compatible(state: RunState, *, seed: int, fingerprint: str,
                     prompts: int) -> None:
    """Refuse, before anything is written, a resume whose checkpoint means nothing for this
    run: another seed, other training prompts, or a ledger naming prompts that do not exist."""
    meta = state.meta
    check_seed(state, seed)
    if meta["data"].get("fingerprint") != fingerprint:
        raise ConfigError("the training prompts differ from the checkpoint's (data.* keys, "
                          "the model's tokenizer or the data files changed); its position in "
                          "the data means nothing for other prompts: resume with the same data")
    for group_id, record in state.ledger["groups"].items():
        index = record["prompt_index"]
        if not isinstance(index, int) or not 0 <= index < prompts:
            raise ConfigError(f"{LEDGER_FILE} of the checkpoint: group {group_id!r} names "
                              f"prompt {index!r}, but the training data has {prompts} prompts "
                              f"(0 to {prompts - 1}); the checkpoint does not belong to this "
                              "data")


def restore(controller, state: RunState) -> list[str]:
    """Put a freshly built controller in `state`; returns the ids of the groups requeued to
    be generated again (see the module docstring). Call before `controller.run()`, which then
    publishes the restored version's weights (the trainer must already hold them)."""
    meta = state.meta
    _check_same_data(controller, state)
    controller.ledger.restore(state.ledger)
    controller.window.restore(meta["window"])
    groups = _unpack_groups([e["group"] for e in meta["replay"]["entries"]], state.tensors)
    controller.replay.restore({**meta["replay"], "entries": [
        {**entry, "group": group} for entry, group in zip(meta["replay"]["entries"], groups)]})
    controller.prompt_queue.restore(meta["data"])
    controller.reward.errors = meta["reward_errors"]
    controller.history[:] = meta["history"]
    version, internal, gauss = meta["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state.tensors["rng.torch"])
    requeued = _requeue_unfinished(controller, state)
    controller.restore({"next_group_id": meta["next_group_id"],
                        "governor": meta.get("governor")}, requeued)
    return [group.group_id for group in requeued]


def _check_same_data(controller, state: RunState) -> None:
    """A data position means nothing for other prompts or another seed's permutation."""
    check_compatible(state, seed=controller.settings.seed,
                     fingerprint=controller.train_prompts.fingerprint,
                     prompts=len(controller.train_prompts.prompts))


def _requeue_unfinished(controller, state: RunState) -> list[Group]:
    """Groups not trained at the checkpoint, to go back to the queue in the order they were
    first queued, ahead of any new prompt (their ledger records say so)."""
    requeued = []
    for group_id, record in state.ledger["groups"].items():
        last = State(record["history"][-1]["state"])
        if last not in _UNFINISHED:
            continue
        if last is not State.QUEUED:
            controller.ledger.requeue_lost(
                group_id, f"resumed from the checkpoint of step {state.step}, which does not "
                "keep untrained output: generated again")
        prompt = controller.train_prompts.prompts[record["prompt_index"]]
        requeued.append(Group(group_id, prompt.prompt, prompt.answer,
                              list(prompt.prompt_ids), controller.version))
    return requeued


# -- groups <-> JSON + flat tensors ------------------------------------------------------------

def _pack_groups(groups: list[Group]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Each group's scalars as JSON; every per-token list concatenated into one tensor per
    field (`replay.<field>`) with the lengths beside it (`replay.<field>.lengths`)."""
    ragged: dict[str, list[list]] = {"group_prompt_ids": [], _EXPERTS: [],
                                     **{name: [] for name in _RAGGED}}
    metas = []
    for group in groups:
        ragged["group_prompt_ids"].append(group.prompt_ids)
        trajectories = []
        for trajectory in group.trajectories:
            result = trajectory.result
            for name in _RAGGED:
                ragged[name].append(getattr(result, name) or [])
            experts = result.routed_experts
            ragged[_EXPERTS].append(experts.ids.tolist() if experts is not None else [])
            trajectories.append({
                **{f.name: getattr(trajectory, f.name) for f in fields(Trajectory)
                   if f.name != "result"},
                "result": {f.name: getattr(result, f.name) for f in fields(GenerationResult)
                           if f.name not in _RAGGED and f.name != _EXPERTS},
                "experts": None if experts is None else
                [experts.layers, experts.top_k, experts.ids.typecode],
                "has_loss_mask": result.loss_mask is not None})
        metas.append({**{f.name: getattr(group, f.name) for f in fields(Group)
                         if f.name not in ("prompt_ids", "trajectories")},
                      "trajectories": trajectories})
    tensors = {}
    for name, rows in ragged.items():
        dtype = _RAGGED.get(name, torch.int16 if name == _EXPERTS else torch.int64)
        tensors[f"replay.{name}"] = torch.tensor([x for row in rows for x in row], dtype=dtype)
        tensors[f"replay.{name}.lengths"] = torch.tensor([len(row) for row in rows],
                                                         dtype=torch.int64)
    return metas, tensors


def _unpack_groups(metas: list[dict], tensors: dict[str, torch.Tensor]) -> list[Group]:
    rows = {name: _split(tensors[f"replay.{name}"], tensors[f"replay.{name}.lengths"])
            for name in ("group_prompt_ids", *_RAGGED, _EXPERTS)
            if f"replay.{name}" in tensors}  # experts: none in a checkpoint from before them
    groups = []
    for meta in metas:
        trajectories = []
        for saved in meta["trajectories"]:
            lists = {name: next(rows[name]) for name in _RAGGED}
            if not saved["has_loss_mask"]:
                lists["loss_mask"] = None
            ids = next(rows[_EXPERTS]) if _EXPERTS in rows else []
            result = GenerationResult(**saved["result"], **lists,
                                      routed_experts=_experts(saved.get("experts"), ids))
            trajectories.append(Trajectory(result, **{
                k: v for k, v in saved.items() if k not in ("result", "has_loss_mask", "experts")}))
        scalars = {k: v for k, v in meta.items() if k != "trajectories"}
        groups.append(Group(**scalars, prompt_ids=next(rows["group_prompt_ids"]),
                            trajectories=trajectories))
    return groups


def _experts(shape: list | None, ids: list[int]) -> RoutedExperts | None:
    """A saved trajectory's experts: [layers, top_k, typecode] and its flat ids."""
    return None if shape is None else RoutedExperts(shape[0], shape[1], array(shape[2], ids))


def _split(flat: torch.Tensor, lengths: torch.Tensor):
    """Rows of `flat` as Python lists, one per length, in order."""
    offset = 0
    for length in lengths.tolist():
        yield flat[offset:offset + length].tolist()
        offset += length
