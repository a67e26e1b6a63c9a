"""areal_1p5b_128 charges the log-prob passes AReaL runs and generates at the length its blog
states (issue 35's part-by-part check of the AReaL rows, 2026-12-03).

AReaL's PPO takes the old (behaviour) log-probs from SGLang and, with the decoupled loss,
recomputes the proximal ones in one forward pass over the batch (v0.3.0
realhf/experiments/common/ppo_math_exp.py); its synchronous runs recompute nothing
(recompute_logprob false). The scenario said neither, so the simulated trainer ran an old pass
over the whole batch as well as proximal passes: 1.75 forward passes where AReaL runs 1 (async)
and 1 where it runs 0 (sync)."""

from dataclasses import replace

from eddyrl.core.update_passes import OLD, PROXIMAL, ForwardPass
from eddyrl.sim.policies import policy_config
from eddyrl.sim.runtime import scenario_trainer
from eddyrl.sim.trainer import SimBatch, SimTrainer

SCENARIO = "areal_1p5b_128"
SYNC_ROW = ["sim.rollout.devices=64", "sim.train.devices=64"]  # bench/sim_fidelity.py's split


def _trainer(policy: str, overrides: list[str] = ()) -> SimTrainer:
    return scenario_trainer(policy_config(SCENARIO, list(overrides), policy))


def test_async_runs_one_proximal_pass_per_mini_batch_and_no_old_pass():
    trainer = _trainer("async")
    assert trainer.mini_batches == 4
    assert [p.role for p in trainer.passes] == [PROXIMAL] * 4
    assert [p.mini_batch for p in trainer.passes] == [0, 1, 2, 3]  # each mini-batch once
    assert OLD not in {p.role for p in trainer.passes}


def test_sync_runs_no_log_prob_pass():
    assert _trainer("sync", SYNC_ROW).passes == ()


def test_async_log_prob_passes_cost_one_forward_over_the_batch():
    # equal rows: no imbalance between mini-batches, so the four mini-batch passes add up to
    # one pass over the whole batch (within 1 %); the old + proximal passes charged before
    # were 1.75 of it
    trainer = _trainer("async")
    rows = (4300,) * 8192
    batch = SimBatch(len(rows), sum(r - 300 for r in rows), sum(rows), 4300.0, rows,
                     tuple(r - 300 for r in rows))
    charged = sum(trainer.step_cost(batch).logprob_s.values())
    one_pass = replace(trainer, passes=(ForwardPass(PROXIMAL),)).step_cost(batch).logprob_s
    before = replace(trainer, passes=(ForwardPass(OLD), *(
        ForwardPass(PROXIMAL, i) for i in range(1, 4)))).step_cost(batch).logprob_s
    assert abs(charged / one_pass[PROXIMAL] - 1) < 0.01
    assert sum(before.values()) / charged > 1.7


def test_async_generates_at_most_the_blogs_8192_tokens():
    # AReaL v0.3 blog, the note under Table 3 (its 1.5B runs): max_new_tokens=8192 (both
    # rows of bench/sim_fidelity.py's AReaL table: tests/fast/sim/test_fidelity_rows.py)
    assert policy_config(SCENARIO, [], "async").sim.workload.max_response_tokens == 8192
