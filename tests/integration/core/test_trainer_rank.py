"""A trainer rank as the runtime drives it (no Ray): mini-batches, the KL reference, and the
log-prob mismatch it reports."""

import torch

from eddyrl.config import load_config
from eddyrl.metric_kinds import combine_parts
from eddyrl.resolved import runtime_settings
from eddyrl.runtime.trainer_rank import TrainerRank


def _batch(model_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engines"))
    from fsdp_helpers import make_batch

    batch = make_batch(model_dir)
    batch.ref_logprobs = None
    return batch


def test_kl_reference_and_mismatch(tiny_model_dir, tmp_path):
    config = load_config(overrides=["platform=cpu", "algorithm.kl_coef=0.1", "train.lr=1e-3",
                                    "train.mini_batches=2", f"model.path={tiny_model_dir}",
                                    "cluster.threads_per_worker=1"])
    rank = TrainerRank(runtime_settings(config).trainer, 0, 1, f"file://{tmp_path}/pg",
                       tiny_model_dir)
    try:
        batch = _batch(tiny_model_dir)
        # the reference is the initial policy: before any step it equals the trained one
        torch.testing.assert_close(rank.reference.compute_logprobs(batch),
                                   rank.engine.compute_logprobs(batch))
        first = rank.train(batch)
        assert batch.ref_logprobs is not None
        assert rank.engine.version == 2  # two mini-batches, two optimizer steps
        # old_logprobs in the helper batch are noisy on purpose: the mismatch must show it
        assert first["mismatch_abs_max"] > 0.1
        second = rank.train(_batch(tiny_model_dir))
        assert second["kl_ref"] > first["kl_ref"] >= 0  # the policy moves from the reference
        assert rank.reference.version == 0
    finally:
        rank.engine.close()
        rank.reference.close()


def test_decoupled_loss_on_policy_gives_the_plain_grpo_update(tiny_model_dir, tmp_path):
    """On-policy (behaviour = proximal = current), the decoupled objective with truncated IS
    and dual clip must produce exactly the plain PPO-clip update."""
    weights = {}
    for name, extra in (("plain", []),
                        ("decoupled", ["algorithm.decoupled=true", "algorithm.tis_cap=2.0",
                                       "algorithm.dual_clip=3.0"])):
        config = load_config(overrides=["platform=cpu", "train.lr=1e-3", *extra,
                                        f"model.path={tiny_model_dir}"])
        rank = TrainerRank(runtime_settings(config).trainer, 0, 1,
                           f"file://{tmp_path}/{name}", tiny_model_dir)
        try:
            batch = _batch(tiny_model_dir)
            batch.old_logprobs = rank.engine.compute_logprobs(batch) * batch.loss_mask
            metrics = rank.train(batch)
            assert metrics["mismatch_abs_max"] < 1e-6
            weights[name] = {k: v.clone() for b in rank.engine.export_weights(1 << 30)
                             for k, v in b.items()}
        finally:
            rank.engine.close()
    for key, value in weights["plain"].items():
        torch.testing.assert_close(weights["decoupled"][key], value, atol=1e-6, rtol=0)


def test_a_streamed_step_trains_as_the_whole_batch(tiny_model_dir, tmp_path):
    """train.stream_chunks = 2 trains the batch in two calls of half the optimizer steps each
    (the controller hands a part over once its groups are collected): with the decoupled loss
    (proximal log-probs at each optimizer step's start) and a KL reference, the weights and the
    step's loss after both calls are those of one call over the whole batch."""
    common = ["platform=cpu", "train.lr=1e-3", "train.mini_batches=4", "algorithm.kl_coef=0.1",
              "algorithm.decoupled=true", "algorithm.tis_cap=2.0", f"model.path={tiny_model_dir}",
              "cluster.threads_per_worker=1"]
    weights, metrics = {}, {}
    for chunks in (1, 2):
        config = load_config(overrides=[*common, f"train.stream_chunks={chunks}"])
        rank = TrainerRank(runtime_settings(config).trainer, 0, 1,
                           f"file://{tmp_path}/pg{chunks}", tiny_model_dir)
        try:
            batch = _batch(tiny_model_dir)
            size = len(batch) // chunks
            parts = [rank.train(batch.select(slice(i * size, (i + 1) * size)))
                     for i in range(chunks)]
            assert rank.engine.version == 4  # the same optimizer steps either way
            metrics[chunks] = combine_parts(parts)
            weights[chunks] = {k: v.clone() for b in rank.engine.export_weights(1 << 30)
                               for k, v in b.items()}
        finally:
            rank.engine.close()
            rank.reference.close()
    for key, value in weights[1].items():
        torch.testing.assert_close(weights[2][key], value, atol=1e-5, rtol=0)
    for name in ("loss", "kl_ref", "grad_norm"):
        assert abs(metrics[2][name] - metrics[1][name]) <= 1e-5 * max(1.0, abs(metrics[1][name]))
    # the mismatch is measured before each call's first step: the second half's at the
    # weights after the first half's two steps, so the sums differ; the token counts do not
    assert metrics[2]["mismatch_tokens"] == metrics[1]["mismatch_tokens"]
