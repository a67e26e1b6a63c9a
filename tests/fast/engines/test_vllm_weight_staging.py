"""Weights taken off the trainer's broadcast by the engine's own processes (vllm_transfer.py),
pure logic: the broadcast group's layout, the worker side against a fake group (receiving into
buffers, staging them once the broadcasts are done), and the reload chosen from what a worker
has (vllm-ascend 0.23's NPU worker has no `reload_weights`), with fake workers. (On vLLM's CPU
worker: test_vllm_device_weights.py; device to device: test_vllm_device_to_device.py.)"""

from types import SimpleNamespace

import pytest
import torch

from eddyrl.engines.inference.vllm import weights as vllm_weights
from eddyrl.engines.inference.vllm.transfer import WorkerExtension, plain_spec
from eddyrl.engines.inference.vllm.weights import pack, reload_strategy
from eddyrl.hal import WeightBucketSpec
from eddyrl.runtime.workers import weight_group_layout


def test_the_broadcast_group_gives_each_worker_its_ranks_after_the_trainer():
    assert weight_group_layout([1, 1]) == ([1, 2], 3)  # the worker processes receive
    assert weight_group_layout([2, 1, 4]) == ([1, 3, 4], 8)  # engines with 2 and 4 workers
    assert weight_group_layout([]) == ([], 1)
    with pytest.raises(ValueError, match="at least one rank"):
        weight_group_layout([1, 0])


def test_the_reload_is_chosen_from_what_the_worker_has():
    class Worker032:  # vLLM's GPU / CPU worker, vllm-ascend after 0.23
        def reload_weights(self, weights_iterator=None, is_checkpoint_format=True):
            pass

    ascend_023 = SimpleNamespace(model_runner=SimpleNamespace(model=object()))
    assert reload_strategy(Worker032(), layerwise_available=True) == "reload_weights"
    assert reload_strategy(Worker032(), layerwise_available=False) == "reload_weights"
    assert reload_strategy(ascend_023, layerwise_available=True) == "layerwise"
    with pytest.raises(NotImplementedError, match="no reload_weights"):
        reload_strategy(ascend_023, layerwise_available=False)
    with pytest.raises(NotImplementedError, match="no reload_weights"):
        reload_strategy(SimpleNamespace(model_runner=None), layerwise_available=True)


class _FakeWork:
    def __init__(self, log):
        self.log, self.waited = log, False

    def wait(self):
        self.waited = True
        self.log.append("wait")


class _FakeGroup:
    """Broadcast "receives" by filling the tensor with its rank-0 value, 7."""

    def __init__(self):
        self.log, self.works = [], []

    def broadcast(self, tensor, root):
        assert root == 0
        tensor.fill_(7)
        self.works.append(_FakeWork(self.log))
        return self.works[-1]


def _fake_worker(model):
    class Worker(WorkerExtension):  # what vLLM builds: its worker with our extension mixed in
        rank = 0
        device = torch.device("cpu")
        model_config = "model-config"
        model_runner = SimpleNamespace(model=model)
    return Worker()


def test_the_worker_receives_into_buffers_and_stages_them_once_the_broadcasts_are_done():
    worker = _fake_worker(None)
    group = _FakeGroup()
    worker._eddy_channel = SimpleNamespace(group=group)
    worker.eddy_begin_staging()
    spec = WeightBucketSpec(names=["a", "b"], dtypes=[torch.float32, torch.bfloat16],
                      shapes=[(2, 3), (4,)])
    assert plain_spec(spec) == (["a", "b"], ["float32", "bfloat16"], [[2, 3], [4]])
    assert worker.eddy_receive(*plain_spec(spec)) == 2
    assert not any(w.waited for w in group.works)  # the engine steps on while they run
    worker.eddy_commit_staged()
    assert all(w.waited for w in group.works)
    staged = worker._eddy_staged
    assert staged["a"].shape == (2, 3) and staged["b"].dtype == torch.bfloat16
    assert all(bool((t == 7).all()) for t in staged.values())
    worker.eddy_receive(["c"], ["float32"], [[1]])
    worker.eddy_drop_incoming()  # dropped only after its broadcast is done
    assert group.works[-1].waited and worker._eddy_incoming == {}
    assert set(worker._eddy_staged) == {"a", "b"}  # the staged copy stays


def test_the_layerwise_reload_wraps_one_load_of_every_staged_tensor(monkeypatch):
    calls = []

    class Model:
        def load_weights(self, weights):
            calls.append(("load", [name for name, _ in weights]))

        def modules(self):  # no MoE layer: nothing for the CPU experts' repack
            return iter(())

    model = Model()
    monkeypatch.setattr(vllm_weights, "_layerwise_reload", lambda: (
        lambda m: calls.append(("begin", m)), lambda m, c: calls.append(("finish", m, c))))
    worker = _fake_worker(model)
    worker.eddy_begin_staging()
    worker.eddy_stage(pack({"a": torch.ones(2), "b": torch.zeros(3)}))
    worker.eddy_commit_staged()
    assert worker.eddy_apply_staged() == 2
    assert calls == [("begin", model), ("load", ["a", "b"]), ("finish", model, "model-config")]
