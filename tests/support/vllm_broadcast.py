"""Shared by the tests of weights taken off the trainer's broadcast by a vLLM engine (on the CPU
and device to device): the tiny model's weights shifted, cut into buckets, the trainer's end of
the channel in a thread, and the checks of the outputs after an update."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoModelForCausalLM

from eddyrl.hal.weight_channel import CollectiveChannel
from eddyrl.protocol import GenerationRequest, SamplingParams

TIMEOUT_S = 120.0


def shifted_weights(model_dir, seed):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    return {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}


def in_buckets(weights, size=7):
    names = list(weights)
    return [{k: weights[k] for k in names[i:i + size]} for i in range(0, len(names), size)]


def greedy_outputs(engine, n=4, max_new=30):
    requests = [GenerationRequest(f"g{i}", [1, 35, 33, 19, 5 + i],
                                  SamplingParams(max_new_tokens=max_new, temperature=0.0))
                for i in range(n)]

    async def run():
        return sorted([r async for r in engine.generate(requests)], key=lambda r: r.request_id)
    return asyncio.run(run())


def assert_same_outputs(a, b, tol=1e-4):
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p.logprobs, q.logprobs)) < tol


def connect_trainer(platform, rendezvous, world, join):
    """The trainer's end (rank 0) in a thread while `join()` makes the receivers join."""
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(CollectiveChannel.connect, platform, rendezvous, 0, world,
                              TIMEOUT_S)
        join()
        return trainer.result(timeout=TIMEOUT_S)


def broadcast_while(channel, buckets, receive):
    """The trainer sends every bucket while `receive()` (a coroutine function) takes them."""
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(lambda: [channel.send(bucket) for bucket in buckets])
        try:
            return asyncio.run(receive())
        finally:
            sent.result(timeout=TIMEOUT_S)  # every rank took part: the sends completed


def check_delayed_while_busy(engine, channel, buckets, specs, hosted, new):
    """An update received while the engine hosting `hosted` decodes is staged (the running
    trajectories keep one version) and serves the requests after them."""
    stats, busy = broadcast_while(channel, buckets,
                                   lambda: receive_while_busy(engine, new, specs))
    assert stats.running + stats.waiting  # still busy: the update was delayed
    assert (stats.version, stats.staged_version) == (hosted, new)
    assert {v for r in busy for v in r.versions} == {hosted}  # one version per trajectory
    assert all(set(r.versions) == {new} for r in greedy_outputs(engine, 1, 5))


async def receive_while_busy(engine, version, specs):
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
