"""verl_7b_64 charges the log-prob passes verl runs and trains as verl's 7B run scripts set it
(issue 35's part-by-part check of the verl rows, 2026-12-03; docs/simulator.md).

Sources: volcengine/verl docs/advance/fully_async.md ("Asynchronous Training on 7B Model": 28K
max response, 512 x 16, ppo_mini_batch_size 32, require_batches 4, trigger_parameter_sync_step
4, staleness_threshold 0.5; its table's old_log_prob column is empty for fully async); the
recipe shells published with that table (recipe/fully_async_policy/shell/
dapo_7b_math_fsdp2_{16-16,32_32,64_64}.sh, commit b25bb7d4f) and the colocated experiment
script (recipe/fully_async_policy/exp/qwen2-7B-math_64/fsdp2_colocate/run.sh): gen_tp 4,
sp_size 4, use_dynamic_bsz with ppo_max_token_len_per_gpu = 2 x (2K + 28K), gradient
checkpointing on (set by the colocated script; verl's default for the others),
use_rollout_log_probs=True, no KL. verl's colocated trainer (verl/trainer/ppo/ray_trainer.py)
always recomputes the old log-probs; its fully-async trainer copies the rollout's
(recipe/fully_async_policy/ray_trainer.py, `use_rollout_log_probs`)."""

import pytest

from eddyrl.core.update_passes import OLD
from eddyrl.sim.policies import policy_config
from eddyrl.sim.runtime import scenario_trainer
from eddyrl.sim.trainer import SimBatch, SimTrainer

SCENARIO = "verl_7b_64"
MAX_PROMPT, MAX_RESPONSE, SP = 2 * 1024, 28 * 1024, 4  # the scripts' lengths and sp_size
SIZES = {32: ["sim.rollout.devices=16", "sim.train.devices=16"], 64: [],
         128: ["sim.rollout.devices=64", "sim.train.devices=64"]}  # bench/sim_fidelity.py's

# the scenario's K = 4 over its 4 steps: true, and beside the point here
pytestmark = pytest.mark.filterwarnings(r"ignore:window\.max_staleness = .* loop\.steps")


def _trainer(policy: str, overrides: list[str] = ()) -> SimTrainer:
    return scenario_trainer(policy_config(SCENARIO, list(overrides), policy))


@pytest.mark.parametrize("size", sorted(SIZES))
def test_colocated_recomputes_the_old_log_probs_once_and_nothing_else(size):
    # the table's colocate rows have an old_log_prob column (107.7 / 70.3 / 53.9 s); no
    # reference pass (use_kl_loss and use_kl_in_reward false)
    trainer = _trainer("colocated", SIZES[size])
    assert [(p.role, p.mini_batch) for p in trainer.passes] == [(OLD, None)]


@pytest.mark.parametrize("size", sorted(SIZES))
def test_fully_async_runs_no_log_prob_pass(size):
    # use_rollout_log_probs=True: old_log_probs = rollout_log_probs, the column is empty
    assert _trainer("partial", SIZES[size]).passes == ()


@pytest.mark.parametrize("policy", ["colocated", "partial"])
def test_trainer_settings_are_the_scripts(policy):
    config = policy_config(SCENARIO, [], policy)
    trainer = _trainer(policy)
    # 512 prompts / ppo_mini_batch_size 32 = 16 optimizer steps a step (fully async: 4 local
    # updates of require_batches 4 x 32 prompts between two syncs)
    assert (config.loop.batch_prompts, config.rollout.n_samples) == (512, 16)
    assert config.train.mini_batches == 16
    # fully async trains each require_batches x 32 = 128 prompts once collected, and syncs
    # every trigger_parameter_sync_step = 4 such calls; the colocated trainer takes the batch
    # whole
    chunks = {"colocated": 1, "partial": 4}[policy]
    assert config.train.stream_chunks == chunks
    assert trainer.mini_batches == 16 // chunks  # optimizer steps a training call
    # dynamic batch size: ppo_max_token_len_per_gpu x sp_size tokens a micro-batch of a
    # sequence-parallel group (verl/workers/actor/dp_actor.py), rows bounded by tokens only
    assert trainer.micro_batch_tokens == 2 * (MAX_PROMPT + MAX_RESPONSE) * SP == 245_760
    assert trainer.checkpointing == "full"
    assert config.sim.train.tp == SP and trainer.cost.tp == SP
    assert config.sim.rollout.tp == 4  # gen_tp
    assert config.sim.rollout.max_batch_size == 1024  # vLLM max_num_seqs, verl's default
    assert config.sim.workload.max_response_tokens == MAX_RESPONSE == 28_672
    assert not config.algorithm.dynamic_sampling and config.algorithm.kl_coef == 0


def test_fully_async_runs_at_the_tables_staleness():
    assert policy_config(SCENARIO, [], "partial").sim.staleness_threshold == 0.5


def test_colocated_old_pass_is_one_forward_over_the_batch():
    # equal rows (no imbalance): the old pass costs a quarter of the optimizer steps' compute
    # (forward against forward + backward + the checkpointed recompute), within 2 %
    trainer = _trainer("colocated")
    rows = (2700,) * 8192
    batch = SimBatch(len(rows), sum(r - 300 for r in rows), sum(rows), 2700.0, rows,
                     tuple(r - 300 for r in rows))
    cost = trainer.step_cost(batch)
    assert cost.imbalance == pytest.approx(1.0)
    assert cost.logprob_s[OLD] / cost.compute_s == pytest.approx(0.25, rel=0.02)
