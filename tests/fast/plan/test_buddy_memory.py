"""`train.buddy_replication` in the memory plan: with two or more trainer ranks each rank holds
its shard of the trainable weights (fp32) and of AdamW's moments twice in host memory (its
staging buffer and its ward's copy, engines/training/buddy.py); one rank alone copies nothing.
The device's peak does not change."""

import json

import pytest

from eddyrl.cli import main
from eddyrl.plan.shapes import ModelShape
from eddyrl.plan.training_memory import TrainingOptions, training_memory

SHAPE = ModelShape(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8,
                   head_dim=128, vocab=151936, tied_embeddings=True)  # Qwen3-0.6B
RECIPE = "recipes/qwen3_4b_dapo_math_gpu"  # 4 trainer ranks, no LoRA


def memory(**options):
    return training_memory(SHAPE, TrainingOptions(tokens_per_micro_batch=4096, **options))


def buddy_bytes(trainable: int, world: int) -> int:
    """Two copies of (the fp32 shard + AdamW's two fp32 moments of it), written out apart
    from the plan's own arithmetic."""
    return 2 * (trainable * 4 // world + 2 * trainable * 4 // world)


@pytest.mark.parametrize("offload", ["none", "optimizer", "all"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_buddy_copies_add_two_shards_of_weights_and_moments_to_host_memory(offload, world):
    off = memory(world_size=world, offload=offload)
    on = memory(world_size=world, offload=offload, buddy_replication=True)
    assert on.host - off.host == on.buddy == buddy_bytes(SHAPE.parameters(), world)
    assert off.buddy == 0
    assert on.peak == off.peak and on.moment == off.moment  # the device holds no copy


def test_with_lora_only_the_adapters_are_copied():
    lora = dict(world_size=4, lora_rank=8, lora_targets=("q_proj", "v_proj"))
    adapters = SHAPE.layers * 8 * ((1024 + 2048) + (1024 + 1024))  # r x (in + out) each
    on, off = memory(buddy_replication=True, **lora), memory(**lora)
    assert on.host - off.host == buddy_bytes(adapters, 4)


def test_one_rank_has_no_buddy_and_holds_no_copy():
    assert memory(buddy_replication=True) == memory()
    assert memory(buddy_replication=True, offload="optimizer").host == \
        memory(offload="optimizer").host


def plan_json(capsys, *overrides) -> dict:
    # 0: fits, 1: does not (the recipe's whole-model plan needs fixes on an H100)
    assert main(["plan", RECIPE, "--device", "H100", "--json", *overrides]) in (0, 1)
    return json.loads(capsys.readouterr().out)


def train_role(result: dict) -> dict:
    (device,) = [d for d in result["devices"] if d["label"] == "train"]
    (role,) = device["roles"]
    return role


def test_the_plan_of_a_config_counts_the_copies_by_default(capsys):
    """From the config (`train.buddy_replication`, on by default) to the plan's host figure
    and its line of text; the device's peak is the same either way."""
    on = train_role(plan_json(capsys))  # the recipe: 4 ranks, buddy replication on
    off = train_role(plan_json(capsys, "train.buddy_replication=false"))
    parameters = plan_json(capsys)["parameters"]
    assert on["details"]["host_bytes"] - off["details"]["host_bytes"] == \
        on["details"]["buddy_bytes"] == buddy_bytes(parameters, 4)
    assert on["peak"] == off["peak"]
    one = [train_role(plan_json(capsys, "train.num_workers=1", f"train.buddy_replication={b}"))
           for b in ("true", "false")]
    assert one[0] == one[1] and one[0]["details"]["buddy_bytes"] == 0

    assert main(["plan", RECIPE, "--device", "H100"]) in (0, 1)
    text = capsys.readouterr().out
    assert f"in host memory ({buddy_bytes(parameters, 4) / 2**30:.2f} GiB of it buddy " \
        "copies)" in text


def test_on_the_host_the_copies_are_in_the_trainers_peak(capsys):
    """On the CPU platform the host memory is the trainer's device: the copies count."""
    roles = {}
    for flag in ("true", "false"):
        assert main(["plan", "platform=cpu", "train.num_workers=2",
                     f"train.buddy_replication={flag}", "--json"]) in (0, 1)
        (host,) = json.loads(capsys.readouterr().out)["devices"]
        roles[flag] = host["roles"][0]
    buddy = roles["true"]["details"]["buddy_bytes"]
    assert buddy > 0 and roles["true"]["terms"]["buddy copies"] == buddy
    assert "buddy copies" not in roles["false"]["terms"]
    assert roles["true"]["peak"] - roles["false"]["peak"] == buddy
