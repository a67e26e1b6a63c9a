"""The FSDP2 training engine: one instance per data-parallel rank, on any platform.

The model is a plain Hugging Face causal LM; parallelism is applied afterwards: `fully_shard` on
each decoder layer, then on the root (which also holds the embeddings, the final norm and the LM
head, so tied input/output embeddings stay one parameter in one FSDP group). The root is the
model inside `PolicyForward` (logprob.py), whose forward runs the decoder and the chunked
log-prob head, so the head's weight is used only while the root has it gathered. Everything
device-specific (process group, mesh, device, seeding, kernels) comes from the `Platform`.

Data-parallel exactness: the loss function divides by the global loss-token count (all-reduced
here), so each rank's loss is its share of one global token mean, and the gradient we want is the
SUM of the ranks' gradients. FSDP2's reduce-scatter AVERAGES them, so each backward is scaled by
`world_size`; N ranks then take the same optimizer step as one rank on the whole batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Iterator

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ...metric_kinds import is_maximum
from ...models.config import weights_kwargs
from ...protocol import TrainBatch
from ...errors import ConfigError
from ... import fault_points
from ..config import LoraConfig
from ...hal import Platform
from ...hal import distributed as hd
from .attention import attention_implementation
from . import buddy, fsdp_checkpoint, fsdp_weights
from . import lora as lora_layers
from . import routing_replay
from .base import LossFn, TrainEngine
from .checkpointing import apply_activation_checkpointing, check_checkpointing
from .offload import (check_offload, fsdp_offload_policy, keep_optimizer_state_on_host,
                      move_for_colocation)
from .logprob import PolicyForward, TokenLogProbs
from .packing import MicroBatch, micro_batches, micro_logprobs, packs_prompts, place_rows

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _resolve_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise ConfigError(f"param_dtype = {value!r} is not one of {sorted(DTYPES)} (or None)")
    return DTYPES[value]


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks, found by the class names HF lists as never-to-be-split."""
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in block_names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found "
                         f"(_no_split_modules = {sorted(block_names)})")
    return layers


def _state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's state dict (tied weights under each name, as a full sync sends)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Tied names -> the name the first owner uses (e.g. lm_head.weight -> embed_tokens)."""
    first_name: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first_name.setdefault(id(param), name)
        if owner != name:
            aliases[name] = owner
    return aliases


class FSDPTrainEngine(TrainEngine):
    """`micro_batch_size`: rows per forward/backward (gradients accumulate over a step);
    `grad_clip`: max global grad norm, None or 0 to only measure it; `param_dtype`: compute
    dtype of the gathered weights (bf16 ...), None for fp32; `temperature`: the sampler's;
    `share_prompts`: rows of one prompt share its forward pass, in packs of at most
    `max_packed_tokens` (packing.py; where the model's attention takes the packed mask);
    `attention`: auto, mask or varlen (attention.py): varlen packs each micro-batch's rows into
    one sequence of at most `max_packed_tokens`, with no mask and no prompt sharing."""

    def __init__(self, model_path: str, platform: Platform, rank: int, world_size: int,
                 init_method: str, lr: float = 1e-6, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), grad_clip: float | None = 1.0,
                 micro_batch_size: int = 8, param_dtype: torch.dtype | str | None = None,
                 seed: int = 0, temperature: float = 1.0, local: bool = True,
                 timeout_s: float = 600.0, share_prompts: bool = True,
                 max_packed_tokens: int = 8192, logprob_chunk_tokens: int = 0,
                 max_tokens_per_micro_batch: int = 0, attention: str = "auto",
                 activation_checkpointing: str = "none", offload: str = "none",
                 lora: "LoraConfig | None" = None, buddy_replication: bool = False) -> None:
        from transformers import AutoModelForCausalLM

        if micro_batch_size < 1:
            raise ConfigError(f"micro_batch_size = {micro_batch_size!r}: must be >= 1")
        check_checkpointing(activation_checkpointing)  # before the group: a refusal leaves none
        check_offload(offload)
        if temperature <= 0:
            raise ConfigError(f"temperature = {temperature!r}: must be > 0")
        # attention.py: the platform's variable-length attention (the varlen layout), or None:
        # transformers' default, which takes the shared-prompt layout's mask
        implementation = attention_implementation(attention, platform,
                                                  _resolve_dtype(param_dtype))
        self.model_path, self.platform = model_path, platform
        self.rank, self.world_size = rank, world_size
        self.grad_clip, self.micro_batch_size = grad_clip, micro_batch_size
        self.temperature, self.version = temperature, 0
        # A runtime may already have joined the group (e.g. to share it); then it owns it.
        self._owns_group = not hd.is_initialized()
        if self._owns_group:
            platform.init_process_group(rank, world_size, init_method, timeout_s, local=local)
        platform.manual_seed(seed)
        self.device = platform.device(platform.local_rank())
        self.mesh = platform.device_mesh((world_size,), ("dp",))

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                     attn_implementation=implementation,
                                                     **weights_kwargs(model_path))
        model = platform.apply_model_patches(model)
        self.full_sync_bytes = _state_bytes(model)  # what a sync of the whole model sends
        # lora.py: peft's LoRA layers in place of the targeted linears, everything else frozen;
        # first, so that checkpointing and sharding wrap the layers as they will train
        self.lora = lora if lora is not None and lora.enabled else None
        if self.lora is not None:
            lora_layers.add_adapters(model, self.lora)
        self.aliases = _aliases(model)  # tied names: what a checkpoint's load fills in
        # R3: replays a batch's `routed_experts` in the routers; idle on batches without
        self._replay = routing_replay.RoutingReplay(model)
        mp_policy = self._mixed_precision(_resolve_dtype(param_dtype))
        # checkpointing.py / offload.py: recompute in the backward, and what lives on the host
        apply_activation_checkpointing(model, _decoder_layers(model), activation_checkpointing)
        self.offload_kind = offload
        shard = dict(mesh=self.mesh, mp_policy=mp_policy,
                     offload_policy=fsdp_offload_policy(offload, self.device))
        for layer in _decoder_layers(model):
            fully_shard(layer, **shard)
        # The root is the causal LM with the chunked log-prob head around it (logprob.py), so
        # the head's weight is gathered, and its gradient reduced, inside the root's forward
        # and backward; `self.model` stays the causal LM: HF names for saves and exports.
        self.root = PolicyForward(model)
        fully_shard(self.root, **shard)  # moves shards to the device (host for offload=all)
        self.model = model
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.varlen = implementation is not None
        self.share_prompts = share_prompts and not self.varlen and packs_prompts(model)
        self.max_packed_tokens = max_packed_tokens
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch  # 0: by rows only
        # only what trains: every parameter, or with LoRA the adapter alone
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=lr, betas=tuple(betas),
                                           weight_decay=weight_decay)
        if offload == "optimizer":
            keep_optimizer_state_on_host(self.optimizer, self.device, platform.synchronize)
        # buddy.py: after each step this rank's shard goes to a peer's host memory, from which
        # a lost rank is rebuilt (`restore_shard`); its group and buffers come at the first step
        self.buddy = buddy.engine_store(self, timeout_s) if buddy_replication else None

    def _mixed_precision(self, dtype: torch.dtype | None) -> MixedPrecisionPolicy:
        if dtype is None or dtype == torch.float32:
            return MixedPrecisionPolicy()
        if not self.platform.supports_dtype(dtype):
            raise ConfigError(f"param_dtype = {dtype} is not supported on platform "
                              f"{self.platform.name!r}; use None (fp32)")
        # Gradients are reduced and accumulated in fp32: bf16 sums over ranks lose the tail.
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)

    # ---- micro-batches ------------------------------------------------------------------
    def _micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        """This rank's rows in micro-batches (packing.py: like lengths together, cut after the
        longest row, a prompt's rows sharing its forward), padded with empty ones (rows None)
        to the count of the busiest rank: FSDP forward/backward are collectives, so every rank
        must run the same number. At least one, so that a rank with no rows still takes part."""
        share = self.share_prompts and routing_replay.prompts_routed_alike(batch)
        mine = micro_batches(batch, self.micro_batch_size, share_prompts=share,
                             varlen=self.varlen, max_packed_tokens=self.max_packed_tokens,
                             max_tokens=self.max_tokens_per_micro_batch)
        count = int(hd.all_reduce(torch.tensor([max(len(mine), 1)]), op="max").item())
        return mine + [MicroBatch(None, self._padding_row(batch))] * (count - len(mine))

    @staticmethod
    def _padding_row(batch: TrainBatch) -> TrainBatch:
        """One row that trains nothing: loss mask 0; attention on, so no fully masked row."""
        row = {f.name: None if getattr(batch, f.name) is None else
               torch.zeros((1, *getattr(batch, f.name).shape[1:]),
                           dtype=getattr(batch, f.name).dtype)
               for f in dataclasses.fields(batch)}
        row["attention_mask"] = torch.ones_like(row["attention_mask"])
        return TrainBatch(**row).select_columns(1)  # one position: it only keeps FSDP in step

    def _logprobs(self, micro: MicroBatch) -> TokenLogProbs:
        self._replay.use(routing_replay.layout(micro))  # kept for a checkpointed recompute
        return micro_logprobs(self.root, micro, self.temperature, self.logprob_chunk_tokens)

    # ---- the contract -------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self.model.eval()
        out = torch.zeros(batch.input_ids.shape, device=batch.input_ids.device)
        for micro in self._micro_batches(batch):
            with self.platform.profile_range("eddy.train.logprobs"):
                logprobs = self._logprobs(micro.to(self.device)).logprobs  # padding: gathers
            if micro.rows is not None:
                place_rows(out, micro.rows, micro.batch, logprobs)
        # FSDP2 keeps the root's parameters (embeddings, final norm, LM head) gathered after a
        # forward, expecting a backward to reshard them; with none coming they would stay full
        # size on every rank (for good, on a KL reference engine) and `offload` would move the
        # gathered copies instead of the shards.
        self.root.reshard()
        return out

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, *, extra_tokens: int = 0,
                   external_grads: Callable[[], dict[str, torch.Tensor]] | None = None,
                   logprobs_out: torch.Tensor | None = None) -> dict[str, float]:
        """`logprobs_out`: a [B, L] tensor that receives the log-probs of the step's own
        forward passes, detached: the weights before this update, what `compute_logprobs`
        would give, without a second pass over the batch.
        `extra_tokens` / `external_grads`: loss tokens and gradients of joined replicas
        (elastic pool) outside this data-parallel group. Every rank counts the tokens into the
        global normalisation; after the ranks' own backward passes, each rank adds its shard of
        the external gradient (full tensors in HF names, the same on every rank) to its reduced
        gradient shard: the same sum as adding it before the reduce-scatter, with no new
        communicator and no extra collective."""
        self.model.train()
        # a failed attempt's gradients (a replica whose process died before its gradients
        # came: the runtime reruns the step without it) must not add to this one's
        self.optimizer.zero_grad(set_to_none=True)
        # float64: a float32 count stops being exact past 2**24 tokens per step.
        local_tokens = batch.loss_mask.sum().to(torch.float64).reshape(1)
        total_tokens = int(round(hd.all_reduce(local_tokens, op="sum").item())) + extra_tokens
        loss_sum, metric_sums, metric_maxima = 0.0, {}, {}
        if logprobs_out is not None:
            logprobs_out.zero_()  # positions after a micro-batch's cut: 0, as on padding
        for index, micro in enumerate(self._micro_batches(batch)):
            padding = micro.rows is None
            micro = micro.to(self.device)
            with self.platform.profile_range("eddy.train.forward"):
                logprobs, entropy = self._logprobs(micro)
                if logprobs_out is not None and not padding:
                    place_rows(logprobs_out, micro.rows, micro.batch, logprobs.detach())
                loss, metrics = loss_fn(logprobs, micro.batch, total_tokens)
            # FSDP2 averages gradients over ranks; we want their sum (see the module docstring).
            with self.platform.profile_range("eddy.train.backward"):
                (loss * self.world_size).backward()
            if index == 0:  # a test's fault: the others wait in the next collective
                fault_points.reached("train_step", self.rank, self.version)
            tokens = 0.0 if padding else float(micro.batch.loss_mask.sum())
            loss_sum += float(loss.detach())
            for name, value in metrics.items():
                if is_maximum(name):
                    metric_maxima[name] = max(value, metric_maxima.get(name, value))
                else:
                    metric_sums[name] = metric_sums.get(name, 0.0) + value * tokens
            # the policy's entropy (at the sampler's temperature), a mean over loss tokens
            metric_sums["entropy"] = metric_sums.get("entropy", 0.0) + float(
                (entropy.detach() * micro.batch.loss_mask).sum())

        if external_grads is not None:
            self._add_external_grads(external_grads())
        with self.platform.profile_range("eddy.train.optimizer"):
            grad_norm, nonfinite = self._optimizer_step(total_tokens, loss_sum)
        self.version += 1

        names = sorted(metric_sums)
        sums = hd.all_reduce(torch.tensor([loss_sum] + [metric_sums[n] for n in names],
                                          dtype=torch.float64), op="sum").tolist()
        out = {"loss": sums[0], "grad_norm": grad_norm, "tokens": float(total_tokens),
               "skipped_updates": float(nonfinite)}
        out.update({n: s / max(total_tokens, 1) for n, s in zip(names, sums[1:])})
        if metric_maxima:  # every rank reports the same names (the loss's contract)
            maxima = sorted(metric_maxima)
            highest = hd.all_reduce(torch.tensor([metric_maxima[n] for n in maxima],
                                                 dtype=torch.float64), op="max").tolist()
            out.update(zip(maxima, highest))
        return out

    def _optimizer_step(self, total_tokens: int, loss_sum: float) -> tuple[float, bool]:
        """Clip and step; returns the gradient norm and whether it was non-finite."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(grad_norm, "full_tensor"):  # DTensor grads give a DTensor norm
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        # No loss tokens anywhere, or a non-finite norm: skip the update (Adam's momentum would
        # still move the weights) but not the version, so versions keep counting steps. A
        # non-finite norm (NaN/inf loss or gradient) is logged and counted (`skipped_updates`).
        nonfinite = total_tokens > 0 and not math.isfinite(grad_norm)
        if total_tokens > 0 and not nonfinite:
            self.optimizer.step()
        elif nonfinite and self.rank == 0:
            log.warning(f"optimizer step skipped at version {self.version}: the gradient norm is "
                        f"{grad_norm} (loss {loss_sum}); weights and optimizer state unchanged")
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, nonfinite

    @torch.no_grad()
    def _add_external_grads(self, grads: dict[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = dict(self.model.named_parameters())
        unknown = sorted(set(grads) - set(params))
        if unknown:
            raise KeyError(f"external gradients for unknown parameters {unknown[:3]}")
        for name, full in grads.items():
            param = params[name]
            if isinstance(param, DTensor):
                # src_data_rank=None: every rank holds the full tensor, so each keeps its own
                # shard without any communication.
                full = distribute_tensor(full.to(self.device, param.dtype), param.device_mesh,
                                         param.placements, src_data_rank=None)
                full = full.to(param.device)  # the host, where offload = all keeps gradients
            else:
                full = full.to(param.device, param.dtype)
            param.grad = full.clone() if param.grad is None else param.grad + full

    # ---- whole weights (fsdp_weights.py) and checkpoints (fsdp_checkpoint.py) -----------
    def export_weights(self, bucket_bytes: int, *, low_rank: bool = False
                       ) -> Iterator[dict[str, torch.Tensor]]:
        """Every rank must drain the iterator (`fsdp_weights.export_weights`)."""
        self._settle_copy()
        yield from fsdp_weights.export_weights(self, bucket_bytes, low_rank=low_rank)

    def export_bytes(self, *, low_rank: bool = False) -> int:
        """The bytes `export_weights(low_rank=...)` sends, from the shapes alone."""
        return fsdp_weights.export_bytes(self, low_rank=low_rank)

    def load_full_weights(self, full: dict[str, torch.Tensor], version: int) -> bool:
        """Collective: rank 0's whole weights into every rank's shards; whether exact."""
        return fsdp_weights.load_full_weights(self, full, version)

    def save(self, path: str, *, node_local: bool = False) -> None:
        self._settle_copy()
        fsdp_checkpoint.save(self, path, node_local=node_local)

    def load(self, path: str) -> None:
        fsdp_checkpoint.load(self, path)

    # ---- buddy replication (buddy.py) ----------------------------------------------------
    def snapshot(self) -> None:
        """A copy of this rank's state now, to its buddy (its transfer goes on beside the
        next work): at start, after a checkpoint's load, after a rebuild, and after each RL
        step, once its optimizer steps (`train.mini_batches` of them) and metrics are done,
        so that a copy is always of a step boundary: a rank lost inside a step is rebuilt
        at the step's start, and the step runs again once. Every rank calls it together (the
        first forms the copies' group)."""
        if self.buddy is not None:
            self.buddy.replicate(self.version)

    def _settle_copy(self) -> None:
        """Before a weight export or a checkpoint write: the copy of the last step has
        reached the buddy, so that a rank lost in either is rebuilt at the version it
        holds. Its transfer began at the step's end; what is left of it is waited for here."""
        if self.buddy is not None:
            self.buddy.settle()

    def replication_metrics(self) -> dict[str, float]:
        """What buddy replication cost the last step on this rank's critical path: the copy
        into host memory after it, the wait for the round before it, and the last export's or
        checkpoint's wait for a round to land (`_max`: the slowest rank's)."""
        if self.buddy is None:
            return {}
        stats = self.buddy.stats
        return {"buddy_copy_s_max": stats.copy_s, "buddy_wait_s_max": stats.wait_s,
                "buddy_fence_s_max": stats.fence_s}

    def recovery_copies(self) -> tuple[buddy.ShardCopy | None, buddy.ShardCopy | None]:
        """After a lost rank: this rank's own last copy and its ward's (`BuddyStore.copies`);
        (None, None) without buddy replication."""
        return self.buddy.copies() if self.buddy is not None else (None, None)

    def abandon(self) -> None:
        """Leave a group a rank was lost from (a rebuild follows): the buddy's round ended
        (its failure logged), the process group abandoned (`distributed.abandon`)."""
        if self.buddy is not None:
            self.buddy.close()
            self.buddy = None
        if self._owns_group:
            hd.abandon()

    def restore_shard(self, copy: buddy.ShardCopy) -> None:
        """This rank rebuilt from a copy (`BuddyStore.restore`, or `shard_copy.reshard` of
        the old world's copies): its shards of the weights and optimizer state, its
        generators and version, as they were after `copy.version`. Local: every other rank
        takes its own."""
        buddy.restore_engine(self, copy)

    # ---- memory -------------------------------------------------------------------------
    def offload(self) -> None:
        self._move_to(torch.device("cpu"))
        self.platform.release_memory(("weights",))

    def onload(self) -> None:
        self.platform.restore_memory(("weights",))
        self._move_to(self.device)

    def _move_to(self, device: torch.device) -> None:
        # what lives on the host for good (offload.py) stays there
        move_for_colocation(self.root, self.optimizer, device, self.offload_kind)
        self.platform.synchronize()

    def close(self) -> None:
        if self.buddy is not None:  # its round in flight first: it uses a group of the world
            self.buddy.close()
        if self._owns_group:
            hd.destroy()

