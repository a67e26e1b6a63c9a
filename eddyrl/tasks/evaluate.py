"""Batched generation and held-out accuracy for chat-formatted prompt rows.

This is the reference decoder (plain `model.generate`), used to score warm starts and as
the ground truth that faster inference engines are checked against.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from eddyrl.tasks.reward import reward


def chat_prompt(tokenizer: PreTrainedTokenizerFast, prompt: str) -> str:
    """`prompt` as a single user turn, followed by the assistant header."""
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    device: torch.device,
    batch_size: int = 256,
) -> list[str]:
    """One response per prompt; temperature 0 means greedy, otherwise plain sampling.

    Sampling draws from torch's global generator: seed it with `torch.manual_seed` to repeat.
    """
    # Left padding so every row's last prompt token sits at the same column for generate.
    tokenizer.padding_side = "left"
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": None, "top_p": None}
        if temperature > 0
        else {"do_sample": False}
    )
    responses: list[str] = []
    was_training = model.training
    model.eval()
    for start in range(0, len(prompts), batch_size):
        texts = [chat_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        batch = batch.to(device)
        output = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        new_tokens = output[:, batch["input_ids"].shape[1] :]
        responses.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    model.train(was_training)
    return responses


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    eval_rows: list[dict],
    *,
    max_new_tokens: int,
    device: torch.device,
    temperature: float = 0.0,
    batch_size: int = 256,
    reward_fn=reward,
) -> float:
    """Fraction of `eval_rows` answered correctly (greedy when temperature is 0): `reward_fn`
    (response, answer), arith's by default, gives 1.0."""
    responses = generate_responses(
        model,
        tokenizer,
        [row["prompt"] for row in eval_rows],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        device=device,
        batch_size=batch_size,
    )
    correct = sum(reward_fn(text, row["answer"]) == 1.0 for text, row in zip(responses, eval_rows))
    return correct / max(len(eval_rows), 1)
