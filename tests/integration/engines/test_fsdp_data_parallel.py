"""Two data-parallel ranks take exactly the step one rank takes on the whole batch.

The rows carry 6, 2, 5 and 1 loss tokens, so a per-rank token mean would weigh them differently;
the gradient norm is compared too, because Adam's first steps barely depend on the gradient's
scale and would hide a missing factor of world_size. The ranks also save after step 1 and
replay step 2 from that checkpoint, which must reproduce it bit for bit.
"""

import os

import torch
from fsdp_helpers import join_ranks, make_batch, save_tiny_model, start_ranks

from eddyrl.core.losses import make_policy_loss
from eddyrl.engines.training.fsdp import FSDPTrainEngine
from eddyrl.hal import get_platform

WORLD = 2
LOSS = make_policy_loss(clip_low=0.2, clip_high=0.28, kl_coef=0.05)
# Step 1: each rank gets half the rows. Step 2: rank 0 gets three rows (two micro-batches of at
# most 2) and rank 1 one row, so rank 1 must run a padding micro-batch to keep FSDP in step.
SPLITS = ([slice(0, 2), slice(2, 4)], [slice(0, 3), slice(3, 4)])
ENGINE_ARGS = dict(lr=1e-3, micro_batch_size=2, seed=0)


def _export(engine):
    return {k: v.clone() for b in engine.export_weights(1 << 30) for k, v in b.items()}


def _run(engine, batch, steps_rows):
    """One step per entry of `steps_rows`; metrics and (on rank 0) the weights after each."""
    history = []
    for rows in steps_rows:
        metrics = engine.train_step(batch.select(rows), LOSS)
        history.append((metrics, _export(engine)))
    return history


def assert_ranks_take_one_ranks_steps(expected, ranks) -> None:
    """Each step of the two ranks (`ranks`: each rank's history of `_run`) against one rank's
    on the whole batch (`expected`): metrics within 1e-5, the ranks' metrics equal, rank 0's
    weights close; rank 1 receives no full weights."""
    assert all(weights == {} for _, weights in ranks[1])  # only rank 0 receives full weights
    for step, ((want_metrics, want), (got_metrics, got)) in enumerate(zip(expected, ranks[0])):
        for key in ("loss", "grad_norm", "tokens", "clip_fraction", "kl_ref",
                    "mismatch_max_abs", "mismatch_kl", "is_ratio_mean", "is_ratio_sq_mean"):
            tolerance = 1e-5 * max(1.0, abs(want_metrics[key]))
            assert abs(got_metrics[key] - want_metrics[key]) <= tolerance, (step, key)
            assert ranks[1][step][0][key] == got_metrics[key], (step, key)  # ranks agree
        assert got.keys() == want.keys()
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        # Adam divides each gradient element by its own magnitude (plus eps = 1e-8), so for an
        # element whose gradient is near eps, float summation order (which rows share a
        # micro-batch: here 2+2 rows on the ranks, two length-sorted pairs on the one rank)
        # moves the step by a visible fraction of lr (measured: 1.5e-5 at lr 1e-3). A wrong
        # row, mask or position moves weights by ~lr: 5e-5 still tells the two apart.
        assert worst < 5e-5, f"step {step}: max abs weight difference {worst:.2e}"


def _worker(rank, model_dir, init_file, out_prefix, batch):
    torch.set_num_threads(1)  # two ranks share two cores with everything else
    os.environ["LOCAL_RANK"] = str(rank)
    engine = FSDPTrainEngine(model_dir, get_platform("cpu"), rank, WORLD, f"file://{init_file}",
                             **ENGINE_ARGS)
    my_rows = [split[rank] for split in SPLITS]
    try:
        history = _run(engine, batch, my_rows[:1])
        engine.save(f"{out_prefix}.ckpt")  # sharded optimizer state: one file per rank
        history += _run(engine, batch, my_rows[1:])
        engine.load(f"{out_prefix}.ckpt")
        replay = _run(engine, batch, my_rows[1:])  # step 2 again from the checkpoint
        torch.save({"history": history, "replay": replay}, f"{out_prefix}.{rank}")
    finally:
        engine.close()


def _start_ranks(*args):
    return start_ranks(_worker, __name__, WORLD, *args)


def test_two_ranks_match_one_rank_on_the_global_batch(tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "tiny"))
    batch = make_batch(model_dir)
    out = str(tmp_path / "out")
    ranks_running = _start_ranks(model_dir, str(tmp_path / "init2"), out, batch)
    single = FSDPTrainEngine(model_dir, get_platform("cpu"), 0, 1,
                             f"file://{tmp_path}/init1", **ENGINE_ARGS)
    try:  # the one-rank reference, while the ranks start
        expected = _run(single, batch, [slice(0, 4)] * len(SPLITS))
    finally:
        single.close()
    join_ranks(ranks_running, timeout_s=150)

    results = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    ranks = [r["history"] for r in results]
    assert_ranks_take_one_ranks_steps(expected, ranks)

    # A two-rank checkpoint restores weights and the sharded optimizer state exactly.
    (replay_metrics, replayed), (step2_metrics, step2) = results[0]["replay"][0], ranks[0][1]
    assert replay_metrics == step2_metrics
    assert all(torch.equal(replayed[k], step2[k]) for k in step2)
