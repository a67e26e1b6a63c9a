"""The property every RL framework depends on and too few test: for the same tokens and the
same weights, the inference engine's per-token log-probs equal the training engine's (fp32 on
CPU: max abs difference below 1e-4), at the sampling temperature, through the real batch path.
Run for every inference engine (the `engine` fixture, conftest.py): `hf` computes them with the
same transformers model as the trainer; `vllm` with its own kernels (fp32 here too) and its
processed log-probs (after temperature), so the bound holds there as well."""

import asyncio

import pytest
from transformers import AutoTokenizer

from eddyrl.core.batching import build_train_batch
from eddyrl.protocol import GenerationRequest, Group, SamplingParams, Trajectory
from eddyrl.engines.registry import load_engine_class
from eddyrl.hal import get_platform


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_inference_and_training_logprobs_agree(engine, tiny_model_dir, tmp_path, temperature):
    platform = get_platform("cpu")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    sampler = engine
    prompts = ["add 1 2", "add 9 9 9 9", "add 3"]
    groups = []
    for i, text in enumerate(prompts):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_dict=False)
        group = Group(f"g{i}", text, "0", list(ids), 0)
        requests = [GenerationRequest(f"g{i}-{k}", list(ids),
                                      SamplingParams(max_new_tokens=16 + 7 * k,
                                                     temperature=temperature))
                    for k in range(3)]

        async def run(reqs=requests):
            return [r async for r in sampler.generate(reqs)]

        for result in sorted(asyncio.run(run()), key=lambda r: r.request_id):
            group.trajectories.append(Trajectory(result, float(len(result.token_ids) % 2)))
        groups.append(group)
    batch = build_train_batch(groups, tokenizer.pad_token_id)
    trainer = load_engine_class("train", "fsdp")(
        tiny_model_dir, platform, 0, 1, f"file://{tmp_path}/pg", micro_batch_size=4,
        temperature=temperature)
    try:
        trained = trainer.compute_logprobs(batch)
    finally:
        trainer.close()
    mask = batch.loss_mask.bool()
    diff = (trained - batch.old_logprobs)[mask].abs()
    assert mask.sum() > 50
    print(f"{type(engine).__name__} T={temperature}: max |inference - training| = "
          f"{diff.max().item():.2e} over {int(mask.sum())} tokens")
    assert diff.max().item() < 1e-4, f"max |inference - training| = {diff.max().item():.2e}"
