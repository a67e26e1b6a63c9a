"""Peak memory of one FSDP2 training rank, predicted from the model's shape and the run's settings.

Everything follows from the shape, the dtypes and how `engines/training/fsdp.py` runs a step;
no term is fitted to a measurement (bench/memory.py compares the prediction with real peaks).
What it predicts is the bytes held by live tensors, the quantity a device allocator reports as
its peak allocation; allocator caching and fragmentation come on top (a CUDA caching allocator
keeps freed blocks reserved; bench/memory.py measures on CPU with glibc returning large
blocks to the OS at once, so the resident set tracks the live tensors).

The engine (fsdp.py): fp32 master weights, sharded over the ranks (FSDP2: each decoder layer a
group, the root group the embeddings, final norm and LM head); gradients reduce-scattered in
fp32 and kept sharded; AdamW's two fp32 moments per trainable parameter, sharded; the forward
runs on gathered copies in `param_dtype` (FSDP2 copies even at world size 1: the unsharded
parameters are always a buffer of their own). A step is, per micro-batch, a forward through
the decoder and the chunked LM head (engines/training/logprob.py), a backward, and after the
last micro-batch the optimizer step. The peak is the largest of these moments:

- `head forward`: every layer's saved activations, the root gathered, and one chunk of the
  head's forward (engines/training/logprob.py): the chunk's logits (c, and their fp32 cast)
  and their fp32 log-softmax, then that and its exp for the entropy: 8 bytes per [chunk, vocab]
  element; each chunk's buffers are freed before the next chunk's exist.
- `head backward`: the same activations, plus the head's backward: per chunk the recomputed
  log-softmax and its exp (8 bytes per element), or the logits' gradient made from it in
  place (4, and its cast to c when c < 4) beside the weight-gradient matmul's [vocab, hidden]
  result when that matmul cannot add into the fp32 accumulator in place (c < 4); the fp32
  weight-gradient accumulator [vocab, hidden]; the hidden states' gradient [tokens, hidden].
- `layer backward`: the last decoder layer's backward (with checkpointing: its recompute, so
  one layer's full activations beside every layer's checkpointed inputs), two layers gathered
  (FSDP2 prefetches the next layer's all-gather in the backward), the layer's unsharded
  gradients, the LM head's unsharded gradient (c) held until the root's reduce-scatter, and the
  gradients alive inside the layer's backward (activations.backward_working_bytes_per_token).
- `embedding backward`: the end of the backward: the root gathered, its unsharded gradients,
  and the embedding's fresh gradient [vocab, hidden] (c) before it is added into the tied
  head's (untied: it is the embedding's own); every layer's gradient already sharded.
- `root reduce-scatter`: the root's unsharded gradients (c), FSDP2's reduce-scatter input
  (fp32, the root's size) and output (fp32, the root's size / world size).
- `optimizer step`: weights, gradients and moments, plus AdamW's temporaries: the per-tensor
  loop (CPU, and offload `all` whose step runs on the host) makes two of the largest
  parameter shard (`exp_avg_sq.sqrt()` and its division by the bias correction); the foreach
  implementation (GPU, NPU) one per parameter at once (`_foreach_sqrt` over the group).

Gradients of earlier micro-batches (`gradient_accumulation`, a step with more than one
micro-batch) are alive in every moment; the moments are alive in all but offload's.
Offload (offload.py): `optimizer` keeps the moments on the host except during the step;
`all` keeps weights, gradients and moments on the host (FSDP2's CPUOffloadPolicy: each group's
shard is copied to the device before its all-gather, the step runs on the host); what moved
is `host`. Buddy replication (engines/training/buddy.py, `train.buddy_replication`) with two
or more ranks: each rank holds its own shard of the trainable weights (fp32) and of AdamW's
moments twice in host memory, its staging buffer and its ward's copy (`buddy`, counted in
`host`; the step count and RNG state it copies besides are a few bytes). LoRA (rank r on
`lora_targets`): the base weights stay, frozen: no gradients, no moments; the adapters
(r x (in + out) per adapted linear) train.

Sequence parallelism (`sequence_parallel` > 1, DeepSpeed-Ulysses as verl runs it: the planned
trainers of the simulator's scenarios; Eddy's own trainer runs none): a micro-batch's tokens
are split over the group's devices, so each device holds the activations, the LM head's chunk
buffers and the hidden states' gradient of its `tokens / sp`, and around the attention the
all-to-alls' buffers: q, k, v and the attention output of the device's tokens, re-laid out over
the full sequence and a share of the heads, input and output alive together in the layer's
backward. The weights, gradients and moments are sharded over `world_size`, the FSDP group
(verl's fsdp_size; all the trainer's devices by default), whatever the sequence split.

The dense packing mask (`attention: mask`): one bool [S, S] per packed row, alive for the
forward and the backward (the attention kernel keeps it). `eager` attention builds an additive
mask in the compute dtype instead, and keeps the [heads, S, S] probabilities
(activations.py). `varlen` / `flash`: no mask.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .activations import (ATTENTION_KINDS, FP32, LayerTraining, backward_working_bytes_per_token,
                          checkpointed_bytes_per_token, layer_bytes_per_token)
from .shapes import ModelShape

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
CHECKPOINTING = ("none", "full", "selective")
OFFLOAD = ("none", "optimizer", "all")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class TrainingOptions:
    tokens_per_micro_batch: int  # padded tokens of the largest micro-batch
    world_size: int = 1
    param_dtype: str = "fp32"  # compute dtype of the gathered weights
    rows_per_micro_batch: int = 1  # attention rows (packed sequences) in that micro-batch
    activation_checkpointing: str = "none"  # none | full | selective
    logprob_chunk_tokens: int = 0  # 0: the whole micro-batch in one chunk
    offload: str = "none"  # none | optimizer | all
    attention: str = "mask"  # mask (dense [S, S]) | varlen | flash (no mask) | eager
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    lora_dropout: bool = False
    gradient_accumulation: bool = True  # more than one micro-batch a step
    foreach_optimizer: bool = True  # torch's AdamW: foreach on accelerators, per tensor on CPU
    buddy_replication: bool = False  # each rank's shard copied to a peer's host memory
    sequence_parallel: int = 1  # devices a micro-batch's tokens are split over (Ulysses)

    def __post_init__(self) -> None:
        checks = (("param_dtype", self.param_dtype, tuple(DTYPE_BYTES)),
                  ("activation_checkpointing", self.activation_checkpointing, CHECKPOINTING),
                  ("offload", self.offload, OFFLOAD), ("attention", self.attention,
                                                       ATTENTION_KINDS))
        for key, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{key} = {value!r}: must be one of {list(allowed)}")
        for key in ("tokens_per_micro_batch", "world_size", "rows_per_micro_batch",
                    "sequence_parallel"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} = {getattr(self, key)!r}: must be >= 1")
        for key in ("logprob_chunk_tokens", "lora_rank"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} = {getattr(self, key)!r}: must be >= 0")
        unknown = sorted(set(self.lora_targets) - set(LINEARS))
        if self.lora_rank and (unknown or not self.lora_targets):
            raise ValueError(f"lora_targets = {list(self.lora_targets)}: name some of {LINEARS}")


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes on one device at the predicted peak (`moment`), by kind; `moments`: every
    candidate moment's total, for the curious."""

    weights: int  # master shards + gathered copies in the compute dtype
    gradients: int
    optimizer: int  # AdamW moments + the step's temporaries
    activations: int  # decoder layers' saved tensors (+ a layer's backward working set)
    logprob: int  # the LM head's chunk buffers, its saved inputs and weight-gradient buffers
    attention_mask: int
    comm_buffers: int  # reduce-scatter / offload staging buffers
    host: int  # bytes in host memory: what offload keeps there instead, and `buddy`
    buddy: int = 0  # buddy replication's two copies of a shard, in host memory (in `host`)
    moment: str = ""
    moments: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def peak(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logprob
                + self.attention_mask + self.comm_buffers)

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["peak"] = self.peak
        return out


def trainable_parameters(shape: ModelShape, options: TrainingOptions) -> int:
    """Every parameter, or with LoRA the adapters: r x (in + out) per adapted linear."""
    if not options.lora_rank:
        return shape.parameters()
    sizes = linear_sizes(shape)
    per_layer = sum(options.lora_rank * sum(sizes[t]) for t in options.lora_targets)
    return shape.layers * per_layer


def linear_sizes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear of a dense decoder layer."""
    return {"q_proj": (shape.hidden, shape.q_width), "k_proj": (shape.hidden, shape.kv_width),
            "v_proj": (shape.hidden, shape.kv_width), "o_proj": (shape.q_width, shape.hidden),
            "gate_proj": (shape.hidden, shape.intermediate),
            "up_proj": (shape.hidden, shape.intermediate),
            "down_proj": (shape.intermediate, shape.hidden)}


def training_memory(shape: ModelShape, options: TrainingOptions) -> TrainingMemory:
    """The predicted peak of one training rank (module docstring), the largest moment."""
    moments = memory_moments(shape, options)
    name = max(moments, key=lambda m: moments[m].peak)
    return dataclasses.replace(moments[name], moment=name,
                               moments={m: v.peak for m, v in moments.items()})


def memory_moments(shape: ModelShape, o: TrainingOptions) -> dict[str, TrainingMemory]:
    """Every candidate moment of a step (module docstring) with its breakdown."""
    c, w = DTYPE_BYTES[o.param_dtype], o.world_size
    rows, sp = o.rows_per_micro_batch, o.sequence_parallel
    sequence = -(-o.tokens_per_micro_batch // rows)  # a packed row's length, whole
    tokens = -(-o.tokens_per_micro_batch // sp)  # the tokens this device holds
    lora = bool(o.lora_rank)
    train = LayerTraining(o.lora_rank, tuple(o.lora_targets), o.lora_dropout)
    trainable = trainable_parameters(shape, o)
    total = shape.parameters() + (trainable if lora else 0)
    adapter_per_layer = trainable // shape.layers if lora else 0
    root = shape.root_parameters()
    layer = shape.largest_layer_parameters() + adapter_per_layer
    vh = shape.vocab * shape.hidden  # the LM head's weight (the embeddings' when tied)

    # ---- state that lives for the whole step ---------------------------------------------
    master = total * FP32 // w
    moments = 2 * trainable * FP32 // w
    sharded_grads = trainable * FP32 // w
    offloaded = 0
    on_device_master, on_device_moments, on_device_grads = master, moments, sharded_grads
    if o.offload == "optimizer":
        offloaded, on_device_moments = moments, 0
    elif o.offload == "all":
        offloaded = master + moments + sharded_grads
        on_device_master = on_device_moments = on_device_grads = 0
    # the staging buffer and the ward's copy: the trainable shard (fp32) and its moments
    # each; one rank alone has no buddy and copies nothing
    buddy = 2 * (trainable * FP32 // w + moments) if o.buddy_replication and w > 1 else 0
    host = offloaded + buddy
    accumulated = on_device_grads if o.gradient_accumulation else 0
    gathered_root = root * c
    staging = layer * FP32 // w if o.offload == "all" else 0  # a shard copied to the device

    # ---- activations ---------------------------------------------------------------------
    per_layer = [layer_bytes_per_token(shape, c, o.attention, sequence, train, i)
                 for i in range(shape.layers)]
    full_layer = max(per_layer) * tokens
    if o.activation_checkpointing == "none":
        stored = sum(per_layer) * tokens
        recompute = 0
    else:
        stored = shape.layers * tokens * checkpointed_bytes_per_token(
            shape, c, o.activation_checkpointing)
        recompute = full_layer
    working = backward_working_bytes_per_token(shape, c) * tokens
    if sp > 1:  # the all-to-alls' input and output of q, k, v and the attention output
        working += 2 * (2 * shape.q_width + 2 * shape.kv_width) * c * tokens
    # root-level saved tensors: cos/sin [tokens, head_dim] (c), the final norm (fp32 input,
    # normalised copy when its weight trains), and the head's input, gathered per position (c)
    root_saved = tokens * (2 * shape.head_dim * c + shape.hidden * (FP32 + c + c) + 4 * FP32)
    mask = 0  # over whole rows: under Ulysses each device attends over the full sequence
    if o.attention == "mask":
        mask = rows * sequence * sequence  # bool
    elif o.attention == "eager":
        mask = rows * sequence * sequence * c  # additive

    # ---- the LM head (logprob.py) --------------------------------------------------------
    chunk = min(o.logprob_chunk_tokens or tokens, tokens)
    head_trains = not lora
    cast = c if c < FP32 else 0
    # Per chunk (logprob.py, forward and backward alike): the matmul's logits (c) and their
    # fp32 cast, then the fp32 log-softmax beside the logits: 8 bytes per [chunk, vocab]
    # element; the backward then turns the log-softmax into the logits' gradient in place
    # (beside the exp of it for the entropy's gradient: 8 again), casts it to c when c < 4,
    # and adds its product with the chunk's hidden states into the fp32 accumulator: in
    # place (`addmm_`) when the dtypes agree, else through a [vocab, hidden] temporary (c).
    # Every chunk's buffers are freed before the next chunk's exist.
    head_forward = max(2 * FP32, c + cast) * chunk * shape.vocab
    head_backward_chunk = max(
        2 * FP32 * chunk * shape.vocab,
        (FP32 + cast) * chunk * shape.vocab + (vh * c if head_trains and cast else 0))
    head_accumulator = vh * FP32 if head_trains else 0
    grad_hidden = tokens * shape.hidden * c  # also: the final norm's output in the forward
    head_grad = vh * c if head_trains else 0  # the LM head's unsharded gradient, until reduced

    def memory(weights, gradients, optimizer, activations, logprob, attention_mask=0,
               comm=0) -> TrainingMemory:
        return TrainingMemory(weights=int(weights), gradients=int(gradients),
                              optimizer=int(optimizer), activations=int(activations),
                              logprob=int(logprob), attention_mask=int(attention_mask),
                              comm_buffers=int(comm + staging), host=int(host),
                              buddy=int(buddy))

    base_weights = on_device_master + gathered_root
    out = {
        "head forward": memory(base_weights, accumulated, on_device_moments, stored,
                               root_saved + grad_hidden + head_forward, mask),
        "head backward": memory(base_weights, accumulated, on_device_moments, stored,
                                root_saved + head_backward_chunk + head_accumulator
                                + grad_hidden, mask),
        "layer backward": memory(base_weights + min(2, shape.layers) * layer * c,
                                 accumulated + head_grad + layer * c * (not lora),
                                 on_device_moments, stored + recompute + working,
                                 grad_hidden, mask),
    }
    layer_grads = accumulated if o.gradient_accumulation else (
        (trainable - (0 if lora else root)) * FP32 // w if o.offload != "all" else 0)
    if head_trains:
        # tied: the head's gradient and the embedding's fresh one; untied: each its own
        root_grads = 2 * vh * c
        out["embedding backward"] = memory(base_weights, layer_grads + root_grads,
                                           on_device_moments, 0, 0)
        # copy-in: unsharded gradients (c) and the fp32 input; then input and output (/ w)
        out["root reduce-scatter"] = memory(
            on_device_master, layer_grads + max(root * c, root * FP32 // w),
            on_device_moments, 0, 0, comm=root * FP32)
    temporaries = 0
    if o.offload != "all":
        # the largest trainable tensor: the embeddings (or a layer's largest matrix), or with
        # LoRA the largest adapter factor, rank x the wider side of its linear
        largest = (max(vh, shape.hidden * max(shape.intermediate, shape.q_width)) if not lora
                   else o.lora_rank * max(max(linear_sizes(shape)[t]) for t in o.lora_targets))
        temporaries = (trainable * FP32 // w if o.foreach_optimizer
                       else 2 * largest * FP32 // w)
    out["optimizer step"] = memory(on_device_master, on_device_grads,
                                   (moments if o.offload != "all" else 0) + temporaries, 0, 0)
    return out
