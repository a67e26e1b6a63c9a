"""Training state in host memory (`train.offload`), and where each kind of state lives.

- `none`: weights, gradients and AdamW state on the device.
- `optimizer`: AdamW's moments (8 bytes per parameter shard in fp32, the largest piece of
  training state after the activations) live in host memory between steps. They are copied to
  the device for the optimizer step and back after it, through optimizer hooks
  (`keep_optimizer_state_on_host`). Why this and not a step on the host (DeepSpeed's
  ZeRO-Offload): the memory that limits a run is the forward/backward peak, when the
  activations are live, and there the moments are absent; the step itself runs the device's
  kernel, so the update is the plain one, bit for bit; and on a GPU node the ranks share the
  host's cores, so a host Adam over a rank's shard is the slow part of a step, while the copies
  (16 bytes per parameter shard per step over PCIe, from and into pinned memory) are not. The
  price: during the step the moments are on the device beside the weights and gradients; where
  that is the peak, or the device cannot hold the moments even then, use `all`.
- `all`: FSDP2's `CPUOffloadPolicy`: the sharded weights, the reduced gradients and the
  optimizer state live in host memory; each layer's shard is copied to the device before its
  all-gather, the gradients back after the reduce-scatter, and the optimizer step runs on the
  host. The least device memory, for the most host traffic and a host-speed optimizer step.

On a CPU platform "host" and "device" are the same memory: every path runs (the tests pin each
to the plain step) but nothing is saved, and a measurement there shows only the code's overhead.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from ...errors import ConfigError

OFFLOAD_KINDS = ("none", "optimizer", "all")
HOST = torch.device("cpu")


def check_offload(kind: str) -> str:
    if kind not in OFFLOAD_KINDS:
        raise ConfigError(f"offload = {kind!r}: must be one of {list(OFFLOAD_KINDS)}")
    return kind


def fsdp_offload_policy(kind: str, device: torch.device) -> OffloadPolicy:
    """What `fully_shard` takes for `kind`; host memory is pinned where a device needs copies
    from it (pinning needs an accelerator, and a host-only run copies nothing)."""
    if check_offload(kind) == "all":
        return CPUOffloadPolicy(pin_memory=device.type != HOST.type)
    return OffloadPolicy()


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every state tensor of `optimizer` to `device`, except 0-dim ones: Adam's step counters,
    which live on the host by design. Non-blocking: a copy to the host lands in pinned memory
    (torch pins the destination of a non-blocking device-to-host copy); the caller
    synchronizes before the host reads it."""
    for param_state in optimizer.state.values():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                param_state[key] = value.to(device, non_blocking=True)


def keep_optimizer_state_on_host(optimizer: torch.optim.Optimizer, device: torch.device,
                                 synchronize) -> None:
    """`offload: optimizer`: the state comes to `device` for each step and goes back to the
    host after it, and after a checkpoint's state is loaded (which puts it beside the
    parameters). `synchronize`: the platform's, so that the host copies are complete."""
    def to_device(*_):
        move_optimizer_state(optimizer, device)

    def to_host(*_):
        move_optimizer_state(optimizer, HOST)
        synchronize()

    optimizer.register_step_pre_hook(to_device)
    optimizer.register_step_post_hook(to_host)
    optimizer.register_load_state_dict_post_hook(to_host)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded (DTensor) weight, gathered on its mesh's device even when `all`
    keeps its shard on the host (as torch's own state-dict gather does: the host's collective
    backend is the slow one); a plain tensor as it is."""
    if not hasattr(tensor, "full_tensor"):
        return tensor
    if tensor.device.type != tensor.device_mesh.device_type:
        tensor = tensor.to(tensor.device_mesh.device_type)
    return tensor.full_tensor()


def move_for_colocation(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        device: torch.device, kind: str) -> None:
    """Colocated mode's `offload()` / `onload()`: move what lives on the device to `device`.
    `all` keeps the sharded weights, gradients and optimizer state on the host for good (FSDP2
    expects them there), so only the buffers (rotary tables) move; `optimizer` keeps the
    optimizer state on the host, so only the model moves."""
    if kind == "all":
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)
    else:
        model.to(device)
    if kind == "none":
        move_optimizer_state(optimizer, device)
