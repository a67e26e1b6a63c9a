"""A tiny random Qwen3-MoE saved as an HF directory (the character tokenizer of the dense tiny
model), for the routing-replay tests and bench: 2 layers, 4 experts, top-2, hidden 64."""

from __future__ import annotations

import torch

NUM_EXPERTS, TOP_K, LAYERS = 4, 2, 2


def save_tiny_moe(path: str, seed: int = 0, *, router_scale: float = 1.0) -> str:
    """`router_scale`: the routers' weights are multiplied by it. The default init leaves
    router logits close together (near ties that flip between dtypes); a larger scale makes
    routing decisive, a smaller one fragile."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from eddyrl.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5 * router_scale)  # transformers: std 0.02, near ties
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


PROMPTS = ([1, 35, 33, 19, 5], [1, 40, 12, 7], [1, 22, 9, 30, 31, 8])


def rollout_groups(engine, *, samples: int = 2, max_new_tokens: int = 12,
                   prompts=PROMPTS, tag: str = "g") -> list:
    """One group per prompt of `samples` responses from `engine` (temperature 1, stop at the
    tokenizer's eos 2), rewards 0, 1, 0, ... so every group trains."""
    import asyncio

    from eddyrl.protocol import GenerationRequest, Group, SamplingParams, Trajectory

    requests = [GenerationRequest(f"{tag}{p}.{s}", list(prompt), SamplingParams(
        max_new_tokens=max_new_tokens, temperature=1.0, stop_token_ids=(2,), seed=100 * p + s))
        for p, prompt in enumerate(prompts) for s in range(samples)]

    async def run():
        return {r.request_id: r async for r in engine.generate(requests) if r.final}

    results = asyncio.run(run())
    return [Group(f"{tag}{p}", "", "", list(prompt), 0,
                  [Trajectory(results[f"{tag}{p}.{s}"], reward=float(s % 2))
                   for s in range(samples)])
            for p, prompt in enumerate(prompts)]
