"""Supervised warm start for the tiny policy on arith demonstrations, on enciphered words
(`tasks/cipher.py`), or on reference episodes of the tiny multi-turn tool task
(`tasks/tool_task.py`).

The warm start is deliberately short: it teaches the response format and some arithmetic,
leaving held-out accuracy modest so that RL has visible room to climb.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from eddyrl.models.tiny import TinyModelConfig, build_tiny_model, build_tokenizer
from eddyrl.tasks.arith import (
    ArithTaskConfig,
    demonstration,
    format_prompt,
    generate_rows,
    max_response_chars,
    parse_prompt,
)
from eddyrl.tasks import cipher, tool_task
from eddyrl.tasks.evaluate import chat_prompt, evaluate

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
    """Right-padded chat prompt + episode ids; labels on the "model" segments and the end
    token after the last one, IGNORE_INDEX on the prompt, "env" segments and padding. Each
    segment is tokenised alone, as the rollout appends them."""
    sequences, label_rows = [], []
    for prompt, segments in zip(prompts, episodes):
        prompt_ids = tokenizer.encode(chat_prompt(tokenizer, prompt), add_special_tokens=False)
        ids, labels = list(prompt_ids), [IGNORE_INDEX] * len(prompt_ids)
        for speaker, text in segments:
            segment = tokenizer.encode(text, add_special_tokens=False)
            ids += segment
            labels += segment if speaker == "model" else [IGNORE_INDEX] * len(segment)
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
        sequences.append(ids)
        label_rows.append(labels)
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    labels = torch.full((len(sequences), width), IGNORE_INDEX)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, (sequence, label_row) in enumerate(zip(sequences, label_rows)):
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        labels[i, : len(sequence)] = torch.tensor(label_row)
        attention_mask[i, : len(sequence)] = 1
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    return {name: tensor.to(device) for name, tensor in batch.items()}


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
    model = build_tiny_model(tokenizer, seed, model_config).to(device)
    model.train()
    with_tool = isinstance(task, tool_task.ToolTaskConfig)
    with_cipher = isinstance(task, cipher.CipherTaskConfig)
    generate = (tool_task.generate_rows if with_tool
                else cipher.generate_rows if with_cipher else generate_rows)
    train_rows = generate(steps * batch_size, seed, "train", task)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)

    def warmup_then_cosine(step: int) -> float:
        return min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / steps)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
    random.Random(seed).shuffle(train_rows)
    early_stop_rng = random.Random(f"lazy-{seed}")
    careless = no_tool_fraction if with_tool else early_stop_fraction
    loss_value = float("nan")
    for step in range(steps if stop_at is None else stop_at):
        rows = train_rows[step * batch_size : (step + 1) * batch_size]
        stop_early = [early_stop_rng.random() < careless for _ in rows]
        if with_cipher:
            batch = cipher_demonstration_batch(tokenizer, rows, device)
        else:
            batch = (tool_demonstration_batch if with_tool else demonstration_batch)(
                tokenizer, rows, device, stop_early)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
    model.eval()
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
