"""The seconds of one RL training step from its parts: each rank's compute, the FSDP collectives
over the modelled interconnect, the optimizer step, and every log-prob forward pass the
algorithm runs. Every constant is a published measurement, cited where it is defined; none is
fitted to an RL step time.

The step, on dp data-parallel groups of tp devices each (tp splits a sequence's compute: tensor
or sequence parallelism), FSDP-sharding the weights over `shard` devices (all dp·tp by default;
fewer is HSDP, the shard groups' replicas all-reducing their gradients):

- compute: per mini-batch (one optimizer step), the slowest rank's rows, since every optimizer
  step waits for all ranks. A row of s tokens costs 2·P·s + A·s²/2 forward FLOPs (P: matmul
  weights, A: attention FLOPs per context token, a causal token attending to s/2 on average);
  training runs forward + backward (×3), and activation checkpointing recomputes the forward
  (full: ×4; selective: the matmuls only, not the attention). Seconds = FLOPs / (peak ·
  train_mfu · tp). Which rows each rank has is the caller's (the trainer's own partition rule).
- activation exchange inside a group (tp > 1): the all-to-alls of sequence parallelism or the
  all-reduces of tensor parallelism in every layer, on the layer's critical path.
- collectives per micro-batch pass (FSDP2's defaults): the parameters all-gathered in the
  forward and again in the backward (resharded after the forward), the gradients
  reduce-scattered (and all-reduced across HSDP replicas); a forward-only log-prob pass
  gathers once. A collective's time: scheduler/collectives.py `collective_seconds`.
- overlap: FSDP prefetches the next layer's all-gather during this layer's compute, so a pass
  costs max(compute + exchange, communication) plus one layer's communication, which nothing
  hides (the first layer's gather, the last one's reduce-scatter).
- optimizer: AdamW over the rank's shard (fp32 weights, gradients and two moments), memory-bound
  at the HBM bandwidth.
- log-prob passes (reference, old, proximal: core/update_passes.py decides which): a forward
  over their rows, with the same max-over-ranks compute and one all-gather per micro-batch.

Left out: the weights' and optimizer state's host offload (verl's `param_offload` and
`optimizer_offload`: once per update, not per optimizer step), the LM head's softmax
(memory-bound, well under a percent of the matmuls), padding, a single controller's data
movement, and kernel launch latency.

Sans-IO: arithmetic only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

from ..errors import ConfigError
from ..validation import check_choice, check_range
from .collectives import Collective, collective_seconds
from .hardware import Accelerator, ModelSpec

Checkpointing = Literal["none", "full", "selective"]

# -- published figures ---------------------------------------------------------------------------

# Training MFU (model FLOPs over dense BF16 peak) of a dense model, by accelerator. An HF model
# under FSDP2 without torch.compile is what Eddy and verl run.
DENSE_TRAIN_MFU = {
    # Datasheet 3b: 35-45 % suggested for dense 7-32B on H100, between torchtitan FSDP2's
    # 33-39 % (Llama3.1-8B, 8×H100 capped at 500 W) [C5] and Megatron-Core's up to 47 % [C4].
    "H100": 0.40,
    "H200": 0.40,  # the same GH100 die as H100 [A2]
    "H800": 0.40,  # the same GH100 die as H100 [A5]: only NVLink is cut, not the SMs
    # torchtitan FSDP2, Llama3-8B on 64×A100, sequence 8K: 56-58 % [C5]
    "A100": 0.56,
    "A800": 0.56,  # an A100 with a narrower NVLink [A4]
    # No dense-model training MFU on H20 was found. verl's Megatron trainer measures 0.40 for
    # Qwen3-30B-A3B on 8 96 GB GPUs (H20 ⚠) [C8]: a MoE model, which trains below a dense one
    # on the same device (datasheet 3b), so a lower bound. H20 keeps Hopper's SMs at 15 % of
    # H100's clocked FLOP/s (148 of 989 [A12]) with more HBM bandwidth (ridge point 37 FLOP/B
    # against 295): the memory-bound kernels between the GEMMs cost it relatively less, which
    # also argues for at least H100's figure.
    "H20": 0.40,
}
# Datasheet 3b: MoE models train at 20-30 % MFU (C6-C8).
MOE_TRAIN_MFU = 0.25
# Anything else: datasheet 3b's suggested default for dense 7-32B models (35-45 %).
DEFAULT_DENSE_TRAIN_MFU = 0.40

# AdamW reads fp32 weight, gradient and both moments (16 B) and writes weight and moments back
# (12 B) for every parameter of the rank's shard, at the HBM bandwidth (a lower bound: a fused
# kernel streams near it; the step is well under 1 % of a step here either way).
ADAMW_BYTES_PER_PARAM = 28


def published_train_mfu(accelerator: Accelerator, model: ModelSpec) -> float:
    """The training MFU a published benchmark gives for `model`'s kind on `accelerator`."""
    if model.experts:
        return MOE_TRAIN_MFU
    return DENSE_TRAIN_MFU.get(accelerator.name, DEFAULT_DENSE_TRAIN_MFU)


# -- the step ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class TrainLayout:
    """How the trainer's devices and weights are laid out, and what a pass moves."""

    dp: int  # data-parallel groups (ranks of the partition)
    tp: int = 1  # devices per group, splitting each sequence's compute
    # FSDP shard group in devices (0: all dp·tp). Fewer: HSDP, replicas all-reduce gradients.
    shard: int = 0
    # the weights each device of a group holds before sharding: all of them (sequence
    # parallelism, verl's Ulysses; FSDP alone) or 1/tp (tensor parallelism)
    tp_splits_weights: bool = False
    checkpointing: Checkpointing = "none"
    param_bytes: int = 2  # the gathered weights' dtype (bf16 mixed precision)
    grad_bytes: int = 4  # the gradients' reduction dtype (fp32, FSDP2's and verl's default)

    def __post_init__(self) -> None:
        check_range("dp", self.dp, 1)
        check_range("tp", self.tp, 1)
        check_range("shard", self.shard, 0)
        check_choice("checkpointing", self.checkpointing, ("none", "full", "selective"))
        check_range("param_bytes", self.param_bytes, 1)
        check_range("grad_bytes", self.grad_bytes, 1)
        if self.shard and (self.dp * self.tp) % self.shard:
            raise ConfigError(f"shard = {self.shard} does not divide the trainer's "
                              f"{self.dp * self.tp} devices (dp {self.dp} × tp {self.tp})")

    @property
    def devices(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True, slots=True)
class RankRows:
    """A pass's rows: for each rank, the tokens of each of its rows; and how many micro-batches
    the busiest rank runs them in (every rank joins every micro-batch's collectives)."""

    rows: tuple[tuple[int, ...], ...]  # per rank, each row's tokens (prompt + response)
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if not self.rows:
            raise ConfigError("a pass needs at least one rank")
        check_range("micro_batches", self.micro_batches, 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainStepCost:
    """One RL training step's seconds by part. `compute_s`: the slowest rank's training
    compute summed over the optimizer steps; `mean_compute_s`: the same for the average rank
    (their ratio is `imbalance`); `activation_exchange_s`: the slowest rank's exchanges inside
    its group (sequence or tensor parallelism); `communication_s`: all the FSDP collectives'
    time, hidden or not; `exposed_communication_s`: what of it adds to the step;
    `optimizer_s`; `logprob_s`: each log-prob pass role's seconds (its exchanges and exposed
    collectives included)."""

    compute_s: float = 0.0
    mean_compute_s: float = 0.0
    activation_exchange_s: float = 0.0
    communication_s: float = 0.0
    exposed_communication_s: float = 0.0
    optimizer_s: float = 0.0
    logprob_s: dict[str, float] = field(default_factory=dict)

    @property
    def imbalance(self) -> float:
        """The slowest rank's compute over the average rank's (1: perfect balance)."""
        return self.compute_s / self.mean_compute_s if self.mean_compute_s else 1.0

    @property
    def update_s(self) -> float:
        """The optimizer steps: compute, activation exchange, exposed collectives, optimizer
        (verl's update_actor)."""
        return (self.compute_s + self.activation_exchange_s + self.exposed_communication_s
                + self.optimizer_s)

    @property
    def total_s(self) -> float:
        return self.update_s + sum(self.logprob_s.values())

    def as_dict(self) -> dict[str, float]:
        """Flat, for metrics and reports: train_<part>_s, the imbalance, logprob_<role>_s."""
        return {"train_compute_s": self.compute_s, "train_imbalance": self.imbalance,
                "train_activation_exchange_s": self.activation_exchange_s,
                "train_communication_s": self.communication_s,
                "train_exposed_communication_s": self.exposed_communication_s,
                "train_optimizer_s": self.optimizer_s, "train_update_s": self.update_s,
                **{f"logprob_{role}_s": seconds for role, seconds in self.logprob_s.items()},
                "train_step_s": self.total_s}


class TrainCost:
    """The parts of a training step of `model` on `accelerator` laid out as `layout`, at
    `train_mfu`."""

    def __init__(self, accelerator: Accelerator, model: ModelSpec, layout: TrainLayout,
                 train_mfu: float) -> None:
        check_range("train_mfu", train_mfu, 0, 1, lo_open=True)
        self.accelerator, self.model, self.layout, self.train_mfu = (
            accelerator, model, layout, train_mfu)

    # compute

    def forward_flops(self, tokens: int) -> float:
        """One row of `tokens` tokens (s), forward: 2·P·s + A·s²/2."""
        return tokens * (2 * self.model.matmul_params
                         + self.model.attention_flops_per_context_token * tokens / 2)

    def training_flops_per_token(self, sequence_length: float) -> float:
        """A token of a row of `sequence_length` tokens, trained: forward and backward (×3),
        plus the checkpointed recompute (full: the forward; selective: its matmuls)."""
        matmuls = 2 * self.model.matmul_params
        attention = self.model.attention_flops_per_context_token * sequence_length / 2
        recompute = {"none": 0.0, "full": matmuls + attention, "selective": matmuls}
        return 3 * (matmuls + attention) + recompute[self.layout.checkpointing]

    def training_flops(self, tokens: int) -> float:
        """One row of `tokens` tokens, trained."""
        return tokens * self.training_flops_per_token(tokens)

    def _seconds(self, flops: float) -> float:
        return flops / (self.accelerator.peak_flops * self.train_mfu * self.layout.tp)

    # collectives

    @property
    def shard_devices(self) -> int:
        return self.layout.shard or self.layout.devices

    @property
    def _weights_per_device(self) -> float:
        """Parameters each device's FSDP group gathers: all, or 1/tp under tensor
        parallelism (FSDP then runs over the dp groups' matching ranks)."""
        split = self.layout.tp if self.layout.tp_splits_weights else 1
        return self.model.total_params / split

    def _group(self) -> tuple[int, int]:
        """(ranks, ranks per node) of the FSDP shard group's collectives."""
        per_node = self.accelerator.devices_per_node
        if self.layout.tp_splits_weights:
            # one rank per tp group: dp ranks, devices_per_node // tp of them per node
            ranks = self.shard_devices // self.layout.tp
            return ranks, max(1, per_node // self.layout.tp)
        return self.shard_devices, per_node

    def all_gather_seconds(self) -> float:
        """The weights gathered once (a forward, or a backward after resharding)."""
        ranks, per_node = self._group()
        return self._per_layer_collective("all_gather",
                                          self._weights_per_device * self.layout.param_bytes,
                                          ranks, per_node)

    def gradient_sync_seconds(self) -> float:
        """Gradients reduce-scattered over the shard group, then all-reduced across the HSDP
        replicas (each holding one shard)."""
        ranks, per_node = self._group()
        grads = self._weights_per_device * self.layout.grad_bytes
        seconds = self._per_layer_collective("reduce_scatter", grads, ranks, per_node)
        replicas = self.layout.devices // self.shard_devices
        if replicas > 1:
            # replica r's rank i holds shard i: the group strides over the shard groups, so a
            # node holds devices_per_node / shard of its members (1 if a shard fills a node)
            stride_per_node = max(1, self.accelerator.devices_per_node // self.shard_devices)
            seconds += self._per_layer_collective("all_reduce", grads / ranks, replicas,
                                                  stride_per_node)
        return seconds

    def _per_layer_collective(self, kind: Collective, total_bytes: float, ranks: int,
                              per_node: int) -> float:
        """FSDP runs one collective per layer (its unit): `layers` collectives of a layer's
        bytes each, at the efficiency of that payload."""
        layers = self.model.layers
        return layers * collective_seconds(self.accelerator, kind, total_bytes / layers, ranks,
                                           per_node)

    # the step

    def optimizer_seconds(self) -> float:
        """AdamW over the device's shard of the weights (1/shard of them either way: under
        tensor parallelism 1/tp of the weights over shard/tp ranks)."""
        shard_params = self.model.total_params / self.shard_devices
        return shard_params * ADAMW_BYTES_PER_PARAM / self.accelerator.hbm_bandwidth

    def activation_exchange_seconds(self, tokens: float, sweeps: int) -> float:
        """Inside a data-parallel group of tp devices, the activations its devices exchange in
        every layer for a micro-batch of `tokens` tokens, over `sweeps` passes through the
        layers (forward 1; training 2, 3 with full checkpointing). Nothing overlaps them: each
        layer waits for its own.

        - sequence parallelism (Ulysses): per layer, all-to-alls of q, k, v and of the
          attention output, (2·H + 2·kv_heads)·d values per token, each device holding
          tokens/tp of them (an all-to-all moves what an all_gather of the local bytes does);
        - tensor parallelism: per layer, two all-reduces of the hidden state of every token.
        """
        tp = self.layout.tp
        if tp == 1 or tokens == 0:
            return 0.0
        per_node = min(tp, self.accelerator.devices_per_node)
        model, width = self.model, self.layout.param_bytes
        if self.layout.tp_splits_weights:
            per_layer = 2 * collective_seconds(self.accelerator, "all_reduce",
                                               tokens * model.hidden * width, tp, per_node)
        else:
            values = (2 * model.heads + 2 * model.kv_heads) * model.head_dim
            per_layer = collective_seconds(self.accelerator, "all_gather",
                                           tokens / tp * values * width, tp, per_node)
        return sweeps * model.layers * per_layer

    def _pass(self, rows: RankRows, flops_of: Callable[[int], float], sweeps: int,
              communication: float, share: float) -> tuple[float, float, float, float]:
        """(compute, mean rank's compute, activation exchange, exposed FSDP communication) of
        one pass, compute and exchange the slowest rank's: each of its micro-batches costs
        max(compute + exchange, communication) plus one layer's communication. `share`: the
        part of its rows a rank computes itself."""
        micro = rows.micro_batches
        computes = [share * self._seconds(sum(flops_of(tokens) for tokens in rank))
                    for rank in rows.rows]
        exchanges = [share * micro * self.activation_exchange_seconds(sum(rank) / micro, sweeps)
                     for rank in rows.rows]
        slowest = max(range(len(computes)), key=lambda rank: computes[rank] + exchanges[rank])
        busy = computes[slowest] + exchanges[slowest]
        exposed = micro * (max(busy / micro, communication)
                           + communication / self.model.layers) - busy
        return computes[slowest], sum(computes) / len(computes), exchanges[slowest], exposed

    def step(self, mini_batches: Sequence[RankRows],
             logprob_passes: Sequence[tuple[str, RankRows]] = (), *,
             share: float = 1.0) -> TrainStepCost:
        """The step: one optimizer step per entry of `mini_batches`, and the forward passes of
        `logprob_passes` ((role, rows) each, e.g. ("old", the whole batch's rows)). `share`
        (0, 1]: the part of its rows each rank computes itself, the rest going to the elastic
        pool's joined replicas (their collectives left out)."""
        check_range("share", share, 0, 1, lo_open=True)
        if not mini_batches:
            raise ConfigError("a training step needs at least one mini-batch")
        gather, sync = self.all_gather_seconds(), self.gradient_sync_seconds()
        train_communication = 2 * gather + sync
        totals = [0.0] * 4  # compute, mean compute, activation exchange, exposed communication
        communication = 0.0
        for rows in mini_batches:
            parts = self._pass(rows, self.training_flops, self.training_sweeps,
                               train_communication, share)
            totals = [total + part for total, part in zip(totals, parts)]
            communication += rows.micro_batches * train_communication
        logprob: dict[str, float] = {}
        for role, rows in logprob_passes:
            compute, _, exchange, exposed = self._pass(rows, self.forward_flops, 1, gather,
                                                       share)
            logprob[role] = logprob.get(role, 0.0) + compute + exchange + exposed
        compute, mean, exchange, exposed = totals
        return TrainStepCost(compute_s=compute, mean_compute_s=mean,
                             activation_exchange_s=exchange, communication_s=communication,
                             exposed_communication_s=exposed,
                             optimizer_s=len(mini_batches) * self.optimizer_seconds(),
                             logprob_s=logprob)

    @property
    def training_sweeps(self) -> int:
        """Passes through the layers a training micro-batch makes: forward, backward, and the
        recomputed forward of full activation checkpointing."""
        return 3 if self.layout.checkpointing == "full" else 2

    def uniform_step(self, tokens: float, sequence_length: int = 0) -> TrainStepCost:
        """One optimizer step over `tokens` tokens split evenly over the ranks, in rows of
        `sequence_length` tokens (0: attention left out): no imbalance, one micro-batch."""
        check_range("tokens", tokens, 0)
        check_range("sequence_length", sequence_length, 0)
        compute = self._seconds(self.training_flops_per_token(sequence_length) * tokens
                                / self.layout.dp)
        exchange = self.activation_exchange_seconds(tokens / self.layout.dp,
                                                    self.training_sweeps)
        communication = 2 * self.all_gather_seconds() + self.gradient_sync_seconds()
        busy = compute + exchange
        exposed = max(busy, communication) + communication / self.model.layers - busy
        return TrainStepCost(compute_s=compute, mean_compute_s=compute,
                             activation_exchange_s=exchange, communication_s=communication,
                             exposed_communication_s=exposed,
                             optimizer_s=self.optimizer_seconds())
