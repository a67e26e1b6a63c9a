"""A Qwen3-MoE's expert count under either key (plan/shapes.py): transformers 5 writes
`num_local_experts` in config.json (the tiny MoE's: eddyrl/assets/moe_warmstart), Qwen's own
files say `num_experts`; both give the same shape, its experts counted."""

from small_configs import small_config

from eddyrl.plan.shapes import shape_from_config

MOE = dict(num_experts_per_tok=2, moe_intermediate_size=48)


def test_num_local_experts_counts_the_experts_as_num_experts_does():
    qwen = shape_from_config(small_config("qwen3_moe", num_experts=4, **MOE))
    transformers_5 = shape_from_config(small_config("qwen3_moe", num_local_experts=4, **MOE))
    assert transformers_5 == qwen and qwen.num_experts == 4
    # per layer: a router [4, 64] and 4 SwiGLU experts of width 48 in place of the dense MLP
    dense = shape_from_config(small_config("qwen3_moe"))
    assert qwen.parameters() - dense.parameters() == 2 * (4 * 64 + 4 * 3 * 64 * 48 - 3 * 64 * 96)
