"""Supervised warm start: one training loop (`train_steps`) over prompt -> response
demonstrations, tokenized one way (`episode_tokens`: the prompt exactly as a rollout renders
it, labels on the response only).

Two sources feed it. A user's model and file (`eddy sft --model DIR --data FILE`, see
`tasks/sft_user.py` and `tasks/sft_data.py`), and the bundled tiny model's own tasks, here:
arith demonstrations, enciphered words (`tasks/cipher.py`), or reference episodes of the tiny
multi-turn tool task (`tasks/tool_task.py`).

The bundled warm start is deliberately short: it teaches the response format and some
arithmetic, leaving held-out accuracy modest so that RL has visible room to climb.
"""

from __future__ import annotations

import math
import random
import time
from itertools import count
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
from transformers import PreTrainedTokenizerFast

from eddyrl.models.tiny import TinyModelConfig, build_tiny_model, build_tokenizer
from eddyrl.models.tiny_moe import TinyMoeConfig, build_tiny_moe_model, load_balancing
from eddyrl.tasks.arith import (
    ArithTaskConfig,
    demonstration,
    format_prompt,
    generate_rows,
    max_response_chars,
    parse_prompt,
)
from eddyrl.tasks import cipher, tool_task
from eddyrl.tasks.evaluate import evaluate
from eddyrl.tasks.prompts import prompt_ids

IGNORE_INDEX = -100  # label value that cross_entropy skips: prompt and padding positions


def demonstration_batch(
    tokenizer: PreTrainedTokenizerFast,
    rows: list[dict],
    device: torch.device,
    stop_early: list[bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response ids with labels only on the response and its end token.
    Where `stop_early[i]`, row i's demonstration leaves out the last number (a wrong answer)."""
    episodes = []
    for i, row in enumerate(rows):
        numbers = parse_prompt(row["prompt"])
        if stop_early and stop_early[i]:
            numbers = numbers[:-1]
        episodes.append([("model", demonstration(format_prompt(numbers)))])
    return episode_batch(tokenizer, [row["prompt"] for row in rows], episodes, device)


def cipher_demonstration_batch(
    tokenizer: PreTrainedTokenizerFast,
    rows: list[dict],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The enciphered word of every row (its true answer), labels on it and the end token."""
    episodes = [[("model", cipher.demonstration(row["prompt"]))] for row in rows]
    return episode_batch(tokenizer, [row["prompt"] for row in rows], episodes, device)


def tool_demonstration_batch(
    tokenizer: PreTrainedTokenizerFast,
    rows: list[dict],
    device: torch.device,
    without_tool: list[bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Reference episodes of the tool task (call, result, answer), labels on the model's turns
    only (the environment's result is masked, as in RL). Where `without_tool[i]`, row i's
    demonstration answers at once without the calculator, as a careless annotator would."""
    episodes = [[("model", f"= {row['answer']}")] if without_tool and without_tool[i]
                else tool_task.demonstration(row["prompt"]) for i, row in enumerate(rows)]
    return episode_batch(tokenizer, [row["prompt"] for row in rows], episodes, device)


def episode_batch(
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    episodes: list[list[tuple[str, str]]],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """`pad_batch` of each prompt's `episode_tokens`."""
    sequences = [episode_tokens(tokenizer, prompt_ids(tokenizer, prompt), segments)
                 for prompt, segments in zip(prompts, episodes)]
    return pad_batch(sequences, tokenizer.pad_token_id, device)


def episode_tokens(
    tokenizer: PreTrainedTokenizerFast,
    prompt: Sequence[int],
    segments: Iterable[tuple[str, str]],
) -> tuple[list[int], list[int]]:
    """(ids, labels) of a prompt's token ids followed by an episode's segments and the end
    token: labels on the "model" segments and the end token, IGNORE_INDEX on the prompt and
    on "env" segments. Each segment is tokenized alone, as the rollout appends them; the end
    token is the one a rollout stops on (`tokenizer.eos_token_id`), added unless the last
    segment already ends with it."""
    ids, labels = list(prompt), [IGNORE_INDEX] * len(prompt)
    for speaker, text in segments:
        # verbose=False: a row longer than the model is refused by name, not warned about
        segment = tokenizer.encode(text, add_special_tokens=False, verbose=False)
        ids += segment
        labels += segment if speaker == "model" else [IGNORE_INDEX] * len(segment)
    if ids[-1] != tokenizer.eos_token_id or labels[-1] == IGNORE_INDEX:
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
    return ids, labels


def pad_batch(
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_token_id: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `labels` and `attention_mask` of (ids, labels) pairs; padding
    is out of attention and has IGNORE_INDEX labels."""
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), width), pad_token_id)
    labels = torch.full((len(sequences), width), IGNORE_INDEX)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, (sequence, label_row) in enumerate(sequences):
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        labels[i, : len(sequence)] = torch.tensor(label_row)
        attention_mask[i, : len(sequence)] = 1
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    return {name: tensor.to(device) for name, tensor in batch.items()}


def train_steps(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    *,
    steps: int,
    lr: float,
    stop_at: int | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train `model` on `batches`, one optimizer step each, and return every step's loss (the
    model's own: the mean cross-entropy over the batch's labelled tokens).

    AdamW (weight decay 0.01), the learning rate warmed up linearly over the first 5% of
    `steps` and then decayed along a cosine to zero at `steps`, gradients clipped to norm 1.
    `stop_at` ends training after that many steps, the schedule still the one of `steps`.
    `on_step(step, loss)` is called after each step (1-based)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)

    def warmup_then_cosine(step: int) -> float:
        return min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / steps)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
    model.train()
    losses = []
    for step, batch in zip(range(steps if stop_at is None else stop_at), batches):
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, losses[-1])
    model.eval()
    return losses


def check_stop_at(stop_at: int | None, steps: int) -> None:
    """`stop_at` ends training within the schedule of `steps`, or is None (all of it)."""
    if stop_at is not None and not 1 <= stop_at <= steps:
        raise ValueError(f"stop_at={stop_at}: must be in 1..steps ({steps})")


def run_sft(
    out_dir: Path | None,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    device: torch.device,
    task: ArithTaskConfig | cipher.CipherTaskConfig | tool_task.ToolTaskConfig = ArithTaskConfig(),
    model_config: TinyModelConfig = TinyModelConfig(),
    eval_count: int = 200,
    early_stop_fraction: float = 0.0,
    no_tool_fraction: float = 0.0,
    stop_at: int | None = None,
) -> dict:
    """Train a fresh tiny policy on demonstrations, save it to `out_dir` (HF format) if
    given, and return metrics including greedy held-out accuracy.

    `early_stop_fraction` of the demonstrations stop one number short, like a careless
    annotator. The policy then learns both habits; greedy decoding often follows the careless
    one, and RL with a correctness reward can teach it to finish the sum. This gives RL a
    large, quick, verifiable gain to show, which 0.86M parameters on a CPU otherwise cannot
    reach within minutes (see eddyrl/assets/tiny_warmstart/README.md for measurements).

    With the tool task (`task` a ToolTaskConfig), `no_tool_fraction` of the demonstrations
    answer without the calculator (the same idea: a habit for RL to unlearn), and no held-out
    accuracy is returned: an episode needs the environment, so `eddy eval` measures it.

    With the cipher task (`task` a CipherTaskConfig) every demonstration is honest. `stop_at`
    (any task) ends training after that many of the `steps` steps, the learning-rate schedule
    still the one of `steps`: an under-trained warm start, as the cipher one is (it knows the
    common letters and half-knows the rest, which RL then learns letter by letter)."""
    check_stop_at(stop_at, steps)
    started = time.monotonic()
    tokenizer = build_tokenizer()
    # a TinyMoeConfig (a TinyModelConfig with experts) makes the mixture-of-experts policy
    build = build_tiny_moe_model if isinstance(model_config, TinyMoeConfig) else build_tiny_model
    model = build(tokenizer, seed, model_config).to(device)
    with_tool = isinstance(task, tool_task.ToolTaskConfig)
    with_cipher = isinstance(task, cipher.CipherTaskConfig)
    generate = (tool_task.generate_rows if with_tool
                else cipher.generate_rows if with_cipher else generate_rows)
    train_rows = generate(steps * batch_size, seed, "train", task)
    random.Random(seed).shuffle(train_rows)
    early_stop_rng = random.Random(f"lazy-{seed}")
    careless = no_tool_fraction if with_tool else early_stop_fraction

    def demonstrations():
        # written batch by batch, the careless ones drawn in training order: the shipped warm
        # starts were made so, and drawing them otherwise would change them
        for step in count():
            rows = train_rows[step * batch_size : (step + 1) * batch_size]
            stop_early = [early_stop_rng.random() < careless for _ in rows]
            if with_cipher:
                yield cipher_demonstration_batch(tokenizer, rows, device)
            else:
                yield (tool_demonstration_batch if with_tool else demonstration_batch)(
                    tokenizer, rows, device, stop_early)

    with load_balancing(model):  # a MoE's loss includes its load-balancing loss
        losses = train_steps(model, demonstrations(), steps=steps, lr=lr, stop_at=stop_at)
    loss_value = losses[-1]
    accuracy = None
    if with_cipher:
        accuracy = evaluate(model, tokenizer, cipher.generate_rows(eval_count, seed, "eval", task),
                            max_new_tokens=cipher.max_response_chars(task) + 1, device=device,
                            reward_fn=cipher.reward)
    elif not with_tool:
        eval_rows = generate_rows(eval_count, seed, "eval", task)
        accuracy = evaluate(model, tokenizer, eval_rows,
                            max_new_tokens=max_response_chars(task) + 1, device=device)
    if out_dir is not None:
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    return {
        "final_loss": loss_value,
        "eval_accuracy": accuracy,
        "train_seconds": time.monotonic() - started,
    }
