"""Weight updates of the `vllm` engine: the names an update must bring, the form buckets travel
in, and `WeightStaging`, which runs inside vLLM's worker: it keeps the buckets while the engine
decodes and swaps them in between two engine steps.

vLLM mixes `WeightStaging` into its worker class (`worker_extension_cls`), so `self` is the
worker; the adapter calls its methods by name through `collective_rpc`, which the engine core
runs between steps. The engine-core process imports this module: it stays light (no vLLM, no
adapter import).
"""

from __future__ import annotations

from pathlib import Path

import torch

PackedTensor = tuple[str, str, list[int], bytes]  # name, dtype, shape, raw bytes


def weight_names(model_path: str, config: dict) -> tuple[frozenset[str], frozenset[str] | None]:
    """(names a weight update must bring, names it may bring; None: not checked): the
    checkpoint's safetensors, plus a tied output head that the checkpoint leaves out. A
    checkpoint in another format is not checked here (vLLM's reload warns of what it missed)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    if not names:
        return frozenset(), None
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

    def eddy_apply_staged(self) -> int:
        """Load every staged tensor in one in-place reload. vLLM's `reload_weights` takes
        checkpoint names (it fuses q/k/v and gate/up itself) and re-runs each layer's
        post-load processing (e.g. the CPU backend's weight repacking), which a bare
        `model.load_weights` would skip. One call with all tensors: a layer given only part
        of its weights would be processed half-loaded."""
        weights = list(self.__dict__.pop("_eddy_staged", {}).items())
        if not hasattr(self, "reload_weights"):
            raise NotImplementedError("this vLLM worker has no reload_weights; the vllm "
                                      "engine needs a vLLM whose Worker.reload_weights "
                                      "takes weights_iterator")
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        return len(weights)

    def eddy_torch_threads(self) -> int:
        """Intra-op threads the worker computes with (for benchmarks' records)."""
        return torch.get_num_threads()
