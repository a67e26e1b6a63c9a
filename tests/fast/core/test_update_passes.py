"""core/update_passes.py decides which log-prob passes an update runs; the update
(core/update.py `PolicyUpdate`) and the simulator both ask it. Here, for every algorithm
setting, the passes it names are exactly the log-prob calls `PolicyUpdate` makes on a recording
engine: same role, same rows, same order."""

import pytest
import torch

from eddyrl.core.config import AlgorithmConfig
from eddyrl.core.update import PolicyUpdate
from eddyrl.core.update_passes import ForwardPass, forward_passes
from eddyrl.protocol import TrainBatch

ROWS = 6


class Recording:
    """A training engine (or KL reference) that notes each log-prob call: its role and the
    first tokens of its rows (row b is token b + 1)."""

    def __init__(self, role: str, calls: list) -> None:
        self.role, self.calls = role, calls

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self.calls.append((self.role, batch.input_ids[:, 0].tolist()))
        return torch.zeros(batch.input_ids.shape)

    def train_step(self, batch, loss_fn, *, extra_tokens=0, external_grads=None,
                   logprobs_out=None):
        return {"loss": 0.0}


def _batch() -> TrainBatch:
    ids = torch.arange(1, ROWS + 1).unsqueeze(1).repeat(1, 3)
    mask = torch.ones(ROWS, 3)
    return TrainBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask,
                      old_logprobs=torch.zeros(ROWS, 3), advantages=torch.ones(ROWS, 3),
                      sample_weights=torch.ones(ROWS),
                      versions=torch.zeros(ROWS, 3, dtype=torch.long))


def _rows(mini_batch: int | None, mini_batches: int) -> list[int]:
    if mini_batch is None:
        return list(range(1, ROWS + 1))
    size = -(-ROWS // mini_batches)
    return list(range(1, ROWS + 1))[mini_batch * size:(mini_batch + 1) * size]


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("mini_batches", [1, 2, 3])
def test_the_passes_are_the_log_prob_calls_the_update_makes(kl_coef, decoupled, mini_batches):
    algorithm = AlgorithmConfig(kl_coef=kl_coef, decoupled=decoupled)
    update = PolicyUpdate(algorithm, mini_batches=mini_batches)
    calls: list = []
    engine = Recording("policy", calls)
    reference = Recording("reference", calls) if update.needs_reference else None
    update(_batch(), engine, reference)
    passes = forward_passes(algorithm, mini_batches)
    expected = [("reference" if p.role == "reference" else "policy",
                 _rows(p.mini_batch, mini_batches)) for p in passes]
    assert calls == expected
    assert update.passes == passes


@pytest.mark.parametrize("algorithm, mini_batches, expected", [
    (AlgorithmConfig(), 1, ()),
    (AlgorithmConfig(), 4, (ForwardPass("old"),)),
    (AlgorithmConfig(kl_coef=0.1), 1, (ForwardPass("reference"),)),
    (AlgorithmConfig(decoupled=True), 1, (ForwardPass("old"),)),
    (AlgorithmConfig(decoupled=True), 3,
     (ForwardPass("old"), ForwardPass("proximal", 1), ForwardPass("proximal", 2))),
])
def test_the_passes_by_setting(algorithm, mini_batches, expected):
    assert forward_passes(algorithm, mini_batches) == expected


def test_old_log_probs_from_the_rollout_engine_need_no_pre_update_pass():
    assert forward_passes(AlgorithmConfig(), 16, rollout_logprobs=True) == ()
    # the decoupled loss then needs every mini-batch's proximal log-probs
    assert forward_passes(AlgorithmConfig(decoupled=True), 2, rollout_logprobs=True) == (
        ForwardPass("proximal", 0), ForwardPass("proximal", 1))
    with pytest.raises(ValueError, match="mini_batches must be >= 1, got 0"):
        forward_passes(AlgorithmConfig(), 0)
