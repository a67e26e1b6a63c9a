"""Weight updates of the `vllm` engine: the names an update must bring, the form buckets travel
in through host memory, and `WeightStaging`, which runs inside vLLM's worker: it keeps the
buckets while the engine decodes and swaps them in between two engine steps. (Buckets received
device to device from the trainer's broadcast: transfer.py.)

vLLM mixes the worker extension (`transfer.WorkerExtension`, which includes
`WeightStaging`) into its worker class, so `self` is the worker; the adapter calls its methods
by name through `collective_rpc`, which the engine core runs between steps. The engine-core
process imports this module: it stays light (no vLLM, no adapter import, at module level).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Awaitable, Callable, Iterable

import torch

from .expert_weights import fused_names, repack_cpu_experts, split_experts

PackedTensor = tuple[str, str, list[int], bytes]  # name, dtype, shape, raw bytes


def weight_names(model_path: str, config: dict) -> tuple[frozenset[str], frozenset[str] | None]:
    """(names a weight update must bring, names it may bring; None: not checked): the
    checkpoint's safetensors, plus a tied output head that the checkpoint leaves out, a MoE's
    experts under the fused names the trainer sends (expert_weights.py). A checkpoint in
    another format is not checked here (vLLM's reload warns of what it missed)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    if not names:
        return frozenset(), None
    names = fused_names(names)
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    return frozenset(names), frozenset(names | tied)


def pack(bucket: dict[str, torch.Tensor]) -> list[PackedTensor]:
    """Tensors as plain values. vLLM's RPC encodes a tensor inside untyped arguments as a bare
    (dtype, shape, buffer view) tuple that its worker-process executor cannot even pickle, so
    the bytes travel as bytes and the worker rebuilds the tensors."""
    packed = []
    for name, tensor in bucket.items():
        host = tensor.detach().to("cpu").contiguous()
        packed.append((name, str(host.dtype).removeprefix("torch."), list(host.shape),
                       host.view(torch.uint8).numpy().tobytes()))
    return packed


def unpack(item: PackedTensor) -> tuple[str, torch.Tensor]:
    name, dtype, shape, data = item
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return name, raw.view(getattr(torch, dtype)).reshape(shape)


def check_known(names: Iterable[str], known: frozenset[str] | None) -> None:
    """A KeyError naming the first weights this model does not have (None: not checked)."""
    unknown = sorted(name for name in names if known is not None and name not in known)
    if unknown:
        raise KeyError(f"weights {unknown[:3]} do not belong to this model")


def check_complete(version: int, received: set[str], required: frozenset[str]) -> None:
    """A KeyError naming the first weights the model needs that the update did not bring."""
    missing = required - received
    if missing:
        raise KeyError(f"weight update for version {version} lacks {sorted(missing)[:3]}")


async def stage_from_host(rpc: Callable[..., Awaitable], buckets: Iterable[dict],
                          known: frozenset[str] | None) -> set[str]:
    """Pack each bucket and hand it to the worker's incoming copy; returns the names sent.
    A bucket with names the model lacks stops the update before it reaches the worker."""
    batches = iter(buckets)
    seen: set[str] = set()
    # The buckets may come off a blocking channel: take and pack them off the event loop.
    while (bucket := await asyncio.to_thread(next, batches, None)) is not None:
        check_known(bucket, known)
        packed = await asyncio.to_thread(pack, bucket)
        seen.update(bucket)
        await rpc("eddy_stage", packed)
    return seen


def worker_device(worker) -> torch.device:
    """The device a vLLM worker computes on (GPU, NPU and CPU workers all keep `device`)."""
    device = getattr(worker, "device", None)
    if device is None:
        raise RuntimeError(f"{type(worker).__name__} has no device attribute; the engine "
                           "cannot load weights into it")
    return torch.device(device)


def reload_strategy(worker, layerwise_available: bool) -> str:
    """How a worker reloads a whole set of checkpoint-format weights in place: its own
    `reload_weights` where it has one (vLLM's GPU and CPU workers, 0.23 on), else vLLM's
    layer-wise reload around the model's `load_weights` ("layerwise": what `reload_weights`
    does inside, and what vllm-ascend 0.23's NPU worker, which has no `reload_weights`, does in
    its own weight-transfer path). Read from the worker, never from a version string."""
    if callable(getattr(worker, "reload_weights", None)):
        return "reload_weights"
    runner = getattr(worker, "model_runner", None)
    if layerwise_available and getattr(runner, "model", None) is not None:
        return "layerwise"
    raise NotImplementedError(
        f"{type(worker).__name__} has no reload_weights and this vLLM no layer-wise reload "
        "(vllm.model_executor.model_loader.reload); the vllm engine cannot update its weights")


def _layerwise_reload():
    """vLLM's layer-wise reload (begin, finish), or None where this vLLM lacks it."""
    try:
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


class WeightStaging:
    """The next weights, kept in the worker until the adapter applies them: buckets arrive in
    an incoming copy, which becomes the staging copy once complete (a failed update leaves the
    previous staging copy as it was)."""

    def eddy_begin_staging(self) -> None:
        self._eddy_incoming: dict[str, torch.Tensor] = {}

    def eddy_stage(self, packed: list[PackedTensor]) -> int:
        """Keep one bucket (on the host: the reload copies it onto the device); returns the
        number of tensors received so far."""
        self._eddy_incoming.update(unpack(item) for item in packed)
        return len(self._eddy_incoming)

    def eddy_drop_incoming(self) -> None:
        self._eddy_incoming = {}

    def eddy_commit_staged(self) -> None:
        self._eddy_staged, self._eddy_incoming = self._eddy_incoming, {}

    def eddy_apply_staged(self, strategy: str | None = None) -> int:
        """Load every staged tensor in one in-place reload (`strategy`: see `reload_strategy`;
        None picks what this worker has). vLLM's reload takes checkpoint names (it fuses q/k/v
        and gate/up itself) and re-runs each layer's post-load processing (e.g. the CPU
        backend's weight repacking), which a bare `model.load_weights` would skip. One call
        with all tensors: a layer given only part of its weights would be processed
        half-loaded."""
        # a MoE's fused experts as the checkpoint's per-expert matrices (expert_weights.py)
        weights = list(split_experts(self.__dict__.pop("_eddy_staged", {}).items()))
        layerwise = _layerwise_reload()
        strategy = strategy or reload_strategy(self, layerwise is not None)
        if strategy == "reload_weights":
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:
            begin, finish = layerwise
            model = self.model_runner.model
            with torch.device(worker_device(self)):  # tensors the reload re-creates go there
                begin(model)
                model.load_weights(weights)
                finish(model, self.model_config)
        # the CPU experts' prepack, which the reload skips (expert_weights.py)
        repack_cpu_experts(getattr(getattr(self, "model_runner", None), "model", None))
        return len(weights)

    def eddy_torch_threads(self) -> int:
        """Intra-op threads the worker computes with (for benchmarks' records)."""
        return torch.get_num_threads()
