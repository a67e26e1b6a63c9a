"""`eddy sft --model DIR --data FILE --out OUT`: a warm start of the user's own Hugging Face
causal LM on the user's prompt -> response file, with the training loop of `tasks/sft.py`.

The edges are checked before any training: the model directory (config.json, safetensors
weights, its own tokenizer: the checks `eddy train` makes), every row of the file
(`tasks/sft_data.py`), and OUT, which must be new, empty, or an earlier `eddy sft` output (it
holds `eddy_sft.json`): a user's other files are never overwritten. OUT is a Hugging Face
directory (model + tokenizer) that `eddy train model.path=OUT` and plain transformers load.

The model trains in float32 (AdamW's small updates vanish in bfloat16) and is saved in the
dtype its config.json names, so OUT is a drop-in replacement for DIR.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..models.config import ModelConfig, load_tokenizer, max_positions, model_json, \
    weights_kwargs
from .sft import IGNORE_INDEX, check_stop_at, pad_batch, train_steps
from .sft_data import Example, SftFileConfig, epoch_batches, load_sft_data, steps_per_epoch

MARKER = "eddy_sft.json"  # what makes a directory an `eddy sft` output, and its summary
_SHOWN = 5  # entries named when OUT is refused


def run_sft_on_file(
    model_path: str,
    data_path: str,
    out_dir: str | Path,
    *,
    file: SftFileConfig,
    lr: float,
    batch_size: int,
    seed: int,
    device: torch.device,
    steps: int | None = None,
    epochs: int | None = None,
    stop_at: int | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict:
    """Fine-tune the model at `model_path` on the rows of `data_path` for `steps` optimizer
    steps (or `epochs` passes over the training rows; default one), save it with its
    tokenizer to `out_dir`, and return the summary that `out_dir/eddy_sft.json` keeps.
    `file.max_length` None is the model's own limit (config.json's positions)."""
    started = time.monotonic()
    if steps is not None and epochs is not None:
        raise ConfigError("eddy sft: give --steps or --epochs, not both")
    if batch_size < 1 or (steps is not None and steps < 1) or (epochs is not None and epochs < 1):
        raise ConfigError(f"eddy sft: --batch-size {batch_size}, --steps {steps} and --epochs "
                          f"{epochs} must each be at least 1")
    model_dir = Path(ModelConfig(path=model_path).resolve(label=f"eddy sft --model {model_path!r}"))
    out = Path(out_dir)
    check_out_dir(out, model_dir)
    tokenizer = load_tokenizer(str(model_dir))
    file = SftFileConfig(**{**asdict(file), "max_length": _max_length(file.max_length, model_dir)})
    data = load_sft_data(data_path, tokenizer, file, seed)
    per_epoch = steps_per_epoch(len(data.train), batch_size)
    steps = steps if steps is not None else (epochs or 1) * per_epoch
    try:
        check_stop_at(stop_at, steps)
    except ValueError as error:
        raise ConfigError(f"eddy sft --stop-at {stop_at}: {error}") from None
    log(f"eddy sft: {len(data.train)} rows to train on ({len(data.held_out)} held out) from "
        f"{data.source}, {data.tokens} tokens; {steps} steps of {batch_size} on {device}")
    model, saved_dtype = load_model(model_dir, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id  # padding is out of attention and loss: any id will do
    held_out_before = held_out_loss(model, data.held_out, batch_size, pad_id, device)
    torch.manual_seed(seed)
    batches = (pad_batch([(e.ids, e.labels) for e in rows], pad_id, device)
               for rows in epoch_batches(data.train, batch_size, seed))
    every = max(1, steps // 10)
    losses = train_steps(model, batches, steps=steps, lr=lr, stop_at=stop_at,
                         on_step=lambda step, loss: log(f"eddy sft: step {step}/{steps} loss "
                                                        f"{loss:.4f}")
                         if step % every == 0 or step == 1 else None)
    held_out_after = held_out_loss(model, data.held_out, batch_size, pad_id, device)
    summary = {
        "model": str(model_path), "data": data.source, "out": str(out),
        "rows": len(data.train), "held_out_rows": len(data.held_out), "tokens": data.tokens,
        "response_tokens": data.response_tokens, "truncated_rows": data.truncated,
        "steps": len(losses), "epochs": round(len(losses) / per_epoch, 3),
        "loss_first": losses[0], "loss_last": losses[-1],
        "held_out_loss_before": held_out_before, "held_out_loss_after": held_out_after,
        "settings": {**asdict(file), "lr": lr, "batch_size": batch_size, "seed": seed,
                     "schedule_steps": steps, "stop_at": stop_at},
        "train_seconds": round(time.monotonic() - started, 3),
    }
    save(model, tokenizer, out, saved_dtype, summary)
    return summary


def check_out_dir(out: Path, model_dir: Path) -> None:
    """OUT may be new, empty, or an earlier `eddy sft` output; anything else is refused naming
    what is in it (the model trained from, above all). Nothing is created here: a refused or
    failed run leaves no empty directory behind."""
    label = f"eddy sft --out '{out}'"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{label}: is a file; a directory for the model is expected")
    if out.is_dir():
        if out.resolve() == model_dir.resolve():
            raise ConfigError(f"{label}: is the --model directory; saving there would "
                              "overwrite the model trained from: choose a new directory")
        entries = sorted(os.listdir(out))
        if entries and MARKER not in entries:
            shown = ", ".join(f"'{name}'" for name in entries[:_SHOWN])
            more = f" and {len(entries) - _SHOWN} more" if len(entries) > _SHOWN else ""
            raise ConfigError(f"{label}: is not empty and is not an eddy sft output (it has "
                              f"no {MARKER}): it holds {shown}{more}. Saving replaces the "
                              "model and tokenizer files: choose a new or empty directory")
        return
    parent = next(p for p in out.absolute().parents if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{label}: cannot be created: '{parent}' is "
                          + ("not a directory" if not parent.is_dir() else "not writable"))


def _max_length(given: int | None, model_dir: Path) -> int:
    """`--max-length`, or the longest sequence the model's positions cover; at most that."""
    limit = max_positions(model_json(model_dir))
    if given is None:
        return limit[0] if limit else 1024
    if limit and given > limit[0]:
        raise ConfigError(f"eddy sft --max-length {given}: the model's positions cover "
                          f"{limit[0]} tokens ({model_dir / 'config.json'} {limit[1]})")
    return given


def load_model(model_dir: Path, device: torch.device) -> tuple[torch.nn.Module, torch.dtype]:
    """The causal LM at `model_dir` in float32 on `device`, and the dtype to save it in."""
    from transformers import AutoModelForCausalLM

    config = model_json(model_dir)
    named = config.get("dtype") or config.get("torch_dtype") or "float32"
    saved_dtype = getattr(torch, named, None) if isinstance(named, str) else None
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                     **weights_kwargs(model_dir))
    except Exception as exc:  # an unknown architecture, a corrupt file: say which directory
        raise ConfigError(f"eddy sft --model '{model_dir}': not a causal language model "
                          f"transformers can load ({type(exc).__name__}: {exc})") from None
    if not isinstance(saved_dtype, torch.dtype) or not saved_dtype.is_floating_point:
        saved_dtype = torch.float32
    return model.to(device), saved_dtype


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, examples: list[Example], batch_size: int,
                  pad_id: int, device: torch.device) -> float | None:
    """Mean cross-entropy over the response tokens of `examples` (None when there are none),
    as the training loss is measured."""
    if not examples:
        return None
    model.eval()
    total, tokens = 0.0, 0
    for begin in range(0, len(examples), batch_size):
        batch = pad_batch([(e.ids, e.labels) for e in examples[begin:begin + batch_size]],
                          pad_id, device)
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]  # position t predicts token t + 1
        total += F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="sum").item()
        tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


def save(model: torch.nn.Module, tokenizer, out: Path, dtype: torch.dtype, summary: dict) -> None:
    """Model (safetensors) and tokenizer into `out`, then the marker that makes it ours."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def summary_lines(summary: dict) -> list[str]:
    """What `eddy sft` prints when done: rows, tokens, loss first -> last, where it is."""
    held = ""
    if summary["held_out_rows"]:
        held = (f"; held-out loss {summary['held_out_loss_before']:.4f} -> "
                f"{summary['held_out_loss_after']:.4f} on {summary['held_out_rows']} rows")
    cut = f", {summary['truncated_rows']} rows truncated" if summary["truncated_rows"] else ""
    return [
        f"rows: {summary['rows']} trained on from {summary['data']}{cut}; their tokens: "
        f"{summary['tokens']} ({summary['response_tokens']} response tokens in the loss)",
        f"steps: {summary['steps']} ({summary['epochs']} epochs); loss "
        f"{summary['loss_first']:.4f} -> {summary['loss_last']:.4f}{held}",
        f"saved: {summary['out']} (model + tokenizer, summary in {MARKER}); RL from it: "
        f"eddy train model.path={summary['out']}",
    ]
