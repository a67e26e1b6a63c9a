"""Weights taken off the trainer's broadcast by the engine's own processes (vllm_transfer.py;
`RolloutWorker` and `RayRuntime` delegate to it), and how a vLLM worker reloads them.

- Pure logic (milliseconds): the broadcast group's layout, the worker side against a fake
  group, the reload chosen from what a worker has (vllm-ascend 0.23's NPU worker has no
  `reload_weights`), with fake workers.
- CPU, for real: a rollout worker whose vLLM engine joins a gloo broadcast group (a CPU run
  forced to `train.weight_channel=collective`: the code path of NCCL / HCCL, another backend),
  the trainer's end in a thread of this process; and the layer-wise reload run on vLLM's CPU
  worker. Both reuse the session's vLLM engine (conftest.py).
- NVIDIA / Ascend: the same device to device, the trainer on device 0 and the engine on device
  1; skipped without two devices of an accelerator (a device may appear once in a
  communicator) and vLLM for it.
"""

import asyncio
import dataclasses
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from eddyrl.engines.inference.vllm import weights as vllm_weights
from eddyrl.protocol import GenerationRequest, SamplingParams
from eddyrl.engines.inference.vllm.transfer import WorkerExtension, plain_spec
from eddyrl.engines.inference.vllm.weights import pack, reload_strategy
from eddyrl.hal import WeightBucketSpec, get_platform, known_platforms
from eddyrl.hal.weight_channel import CollectiveChannel
from eddyrl.runtime.workers import weight_group_layout

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")
TIMEOUT_S = 120.0


def _shifted(model_dir, seed):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    return {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}


def _buckets(weights, size=7):
    names = list(weights)
    return [{k: weights[k] for k in names[i:i + size]} for i in range(0, len(names), size)]


def _greedy(engine, n=4, max_new=30):
    requests = [GenerationRequest(f"g{i}", [1, 35, 33, 19, 5 + i],
                                  SamplingParams(max_new_tokens=max_new, temperature=0.0))
                for i in range(n)]

    async def run():
        return sorted([r async for r in engine.generate(requests)], key=lambda r: r.request_id)
    return asyncio.run(run())


def _same_outputs(a, b, tol=1e-4):
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p.logprobs, q.logprobs)) < tol


def _connect_trainer(platform, rendezvous, world, join):
    """The trainer's end (rank 0) in a thread while `join()` makes the receivers join."""
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(CollectiveChannel.connect, platform, rendezvous, 0, world,
                              TIMEOUT_S)
        join()
        return trainer.result(timeout=TIMEOUT_S)


def _broadcast_while(channel, buckets, receive):
    """The trainer sends every bucket while `receive()` (a coroutine function) takes them."""
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(lambda: [channel.send(bucket) for bucket in buckets])
        try:
            return asyncio.run(receive())
        finally:
            sent.result(timeout=TIMEOUT_S)  # every rank took part: the sends completed


def _check_delayed_while_busy(engine, channel, buckets, specs, hosted, new):
    """An update received while the engine hosting `hosted` decodes is staged (the running
    trajectories keep one version) and serves the requests after them."""
    stats, busy = _broadcast_while(channel, buckets,
                                   lambda: _receive_while_busy(engine, new, specs))
    assert stats.running + stats.waiting  # still busy: the update was delayed
    assert (stats.version, stats.staged_version) == (hosted, new)
    assert {v for r in busy for v in r.versions} == {hosted}  # one version per trajectory
    assert all(set(r.versions) == {new} for r in _greedy(engine, 1, 5))


async def _receive_while_busy(engine, version, specs):
    """Receive while long requests decode one at a time; they are aborted once the stats are
    read (so that no timing decides whether they still run, on any device). Returns (stats
    then, the requests' results)."""
    requests = [GenerationRequest(f"busy{i}", [1, 35, 33, 19, 5 + i],
                                  SamplingParams(max_new_tokens=240)) for i in range(6)]

    async def run():
        return [r async for r in engine.generate(requests)]

    engine.configure(max_batch_size=1)
    task = asyncio.create_task(run())
    goal = engine.stats().tokens_generated + 20
    while engine.stats().tokens_generated < goal:
        await asyncio.sleep(0.001)
    await engine.receive_weights(version, specs)
    stats = engine.stats()
    await engine.abort([r.request_id for r in requests])
    results = await task
    engine.configure(max_batch_size=256)
    return stats, results


# ---- pure logic --------------------------------------------------------------------------------
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

    model = Model()
    monkeypatch.setattr(vllm_weights, "_layerwise_reload", lambda: (
        lambda m: calls.append(("begin", m)), lambda m, c: calls.append(("finish", m, c))))
    worker = _fake_worker(model)
    worker.eddy_begin_staging()
    worker.eddy_stage(pack({"a": torch.ones(2), "b": torch.zeros(3)}))
    worker.eddy_commit_staged()
    assert worker.eddy_apply_staged() == 2
    assert calls == [("begin", model), ("load", ["a", "b"]), ("finish", model, "model-config")]


# ---- CPU, for real -----------------------------------------------------------------------------
@pytest.fixture()
def vllm(vllm_engine, initial_weights):
    vllm_engine.configure(partial_rollout=False, max_batch_size=256)
    asyncio.run(vllm_engine.load_weights(0, [initial_weights]))
    return vllm_engine


def _rollout_worker(monkeypatch, model_dir, engine=None, *overrides):
    """A RolloutWorker as Ray runs it, minus Ray; around `engine` (the session's vLLM engine)
    instead of a new one, or an `hf` engine. Its process-wide settings are put back after."""
    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime import workers

    config = load_config(overrides=[f"model.path={model_dir}", "platform=cpu",
                                    f"rollout.engine={'vllm' if engine else 'hf'}",
                                    f"cluster.timeout_s={TIMEOUT_S}", *overrides])
    if engine is not None:
        monkeypatch.setattr(workers, "load_engine_class",
                            lambda role, name: lambda *args, **kwargs: engine)
    for key in get_platform("cpu").inference_engine_env():
        monkeypatch.setenv(key, "")  # recorded, so the worker's values are undone after
    threads = torch.get_num_threads()
    try:
        return workers.RolloutWorker(runtime_settings(config).rollout, 0, model_dir)
    finally:
        torch.set_num_threads(threads)


def test_an_engine_without_its_own_receiver_leaves_it_to_the_worker(monkeypatch,
                                                                    tiny_model_dir):
    worker = _rollout_worker(monkeypatch, tiny_model_dir)  # hf
    assert worker.engine.weight_ranks() == 0
    assert worker.weight_ranks("collective") == worker.weight_ranks("object_store") == 1
    assert worker._engine_ranks("collective") == 0


@needs_vllm
def test_a_cpu_run_and_a_lendable_worker_keep_the_host_path(monkeypatch, vllm, tiny_model_dir):
    worker = _rollout_worker(monkeypatch, tiny_model_dir, vllm)
    assert vllm.weight_ranks() == 1  # one vLLM worker ("uni" executor)
    # CPU to CPU the channel is the object store: the worker process receives, as before
    assert worker._engine_ranks("object_store") == 0
    assert worker._engine_ranks("host") == 0 and worker.weight_ranks("object_store") == 1
    assert worker._engine_ranks("collective") == 1
    monkeypatch.setattr(worker, "settings",
                        dataclasses.replace(worker.settings, lent_to_training=True))
    assert worker._engine_ranks("collective") == 0  # a replica would need the weights here


@needs_vllm
def test_the_engine_takes_a_collective_channel_s_broadcast_itself(monkeypatch, vllm,
                                                                   tiny_model_dir, tmp_path):
    """Through the RolloutWorker as the runtime drives it: the vLLM worker joins the group
    (gloo here), receives every bucket into its own buffers and loads them; the same weights
    sent through host memory give the same outputs; a wrong update is received whole (the
    trainer is not left waiting), refused, and changes nothing; a busy engine keeps hosting
    its version with the received one staged."""
    worker = _rollout_worker(monkeypatch, tiny_model_dir, vllm)
    offsets, world = weight_group_layout([worker.weight_ranks("collective")])
    rendezvous = f"file://{tmp_path}/weight_channel"
    channel = _connect_trainer(get_platform("cpu"), rendezvous, world, lambda: (
        worker.connect_weight_channel("collective", rendezvous, offsets[0], world)))
    assert worker.engine_receives and worker.channel is None
    try:
        buckets = _buckets(_shifted(tiny_model_dir, 7))
        specs = [channel.describe(bucket) for bucket in buckets]
        assert _broadcast_while(channel, buckets, lambda: worker.load_weights(6, specs)) == 6
        received = _greedy(vllm)
        assert all(set(r.versions) == {6} for r in received)
        asyncio.run(vllm.load_weights(7, buckets))  # the same weights through host memory
        _same_outputs(_greedy(vllm), received)

        bad = [{**buckets[0], "not.a.weight": torch.zeros(2)}] + buckets[1:]
        with pytest.raises(KeyError, match="do not belong"):
            _broadcast_while(channel, bad, lambda: worker.load_weights(
                8, [channel.describe(bucket) for bucket in bad]))
        assert vllm.version == 7 and vllm.stats().staged_version is None
        _same_outputs(_greedy(vllm), received)

        _check_delayed_while_busy(vllm, channel, buckets, specs, hosted=7, new=9)
    finally:
        channel.close()


@needs_vllm
def test_the_layerwise_reload_loads_what_reload_weights_loads(vllm, tiny_model_dir):
    """vllm-ascend 0.23's path (`reload_strategy` "layerwise"), forced on vLLM's CPU worker:
    the outputs match a plain transformers engine holding the same weights."""
    from eddyrl.engines.inference.hf import HFInferenceEngine

    new = _shifted(tiny_model_dir, 11)

    async def reload_layerwise():
        await vllm._rpc_all("eddy_begin_staging")
        await vllm._rpc("eddy_stage", pack(new))
        await vllm._rpc_all("eddy_commit_staged")
        await vllm._rpc_all("eddy_apply_staged", "layerwise")
        await vllm._llm.reset_prefix_cache()
    vllm._thread.run(reload_layerwise())
    hf = HFInferenceEngine(tiny_model_dir, get_platform("cpu"))
    asyncio.run(hf.load_weights(0, [new]))
    _same_outputs(_greedy(vllm), _greedy(hf))


# ---- NVIDIA / Ascend ---------------------------------------------------------------------------
def _accelerators():
    params = []
    for name in known_platforms():
        platform = get_platform(name, require_available=False)
        if platform.device_type == "cpu":
            continue
        reason = platform.unavailable_reason()
        if reason is None and platform.device_count() < 2:
            reason = (f"needs 2 devices (trainer and engine; a device appears once in a "
                      f"communicator), has {platform.device_count()}")
        if reason is None and not VLLM_INSTALLED:
            reason = "vLLM is not installed"
        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.mark.hardware
@pytest.mark.parametrize("platform_name", _accelerators())
def test_weights_reach_vllm_device_to_device(platform_name, tiny_model_dir, tmp_path,
                                             monkeypatch):
    """The trainer's end (this process, device 0) broadcasts over NCCL / HCCL into the vLLM
    worker (device 1); the outputs equal those after the same weights came through host
    memory, and a busy engine keeps its version with the received one staged."""
    from eddyrl.engines.inference.vllm.engine import VLLMInferenceEngine

    platform = get_platform(platform_name)
    with monkeypatch.context() as env:  # the engine-core process sees device 1 only
        env.setenv(platform.visible_devices_env, "1")
        engine = VLLMInferenceEngine(tiny_model_dir, platform, seed=0, dtype="bfloat16")
    try:
        rendezvous = f"file://{tmp_path}/weight_channel"
        channel = _connect_trainer(platform, rendezvous, 2, lambda: (
            engine.connect_weight_channel(rendezvous, 1, 2, TIMEOUT_S)))
        buckets = _buckets(_shifted(tiny_model_dir, 3))
        specs = [channel.describe(bucket) for bucket in buckets]
        _broadcast_while(channel, buckets, lambda: engine.receive_weights(1, specs))
        received = _greedy(engine)
        assert engine.version == 1 and all(set(r.versions) == {1} for r in received)
        asyncio.run(engine.load_weights(2, buckets))  # the same weights through host memory
        _same_outputs(_greedy(engine), received, tol=1e-3)

        _check_delayed_while_busy(engine, channel, buckets, specs, hosted=2, new=3)
        channel.close()
    finally:
        engine.close()
