"""The node's cluster address reaches vLLM's worker processes when they join a weight group, so
their collective sockets go where every other member's go (no vLLM needed: a fake RPC)."""

import asyncio

from eddyrl.engines.inference.vllm import transfer


def test_the_address_travels_with_the_connect_call_to_every_worker():
    calls = []

    async def rpc_all(method, *args):
        calls.append((method, args))
        return [args[2] + rank for rank in range(2)]  # two workers after the sender's rank 0

    ranks = asyncio.run(transfer.connect(rpc_all, "cpu", "tcp://10.0.0.1:1234", 1, 3, 60.0,
                                         "10.0.0.2"))
    assert ranks == [1, 2]
    assert calls == [("eddy_connect_weights", ("cpu", "tcp://10.0.0.1:1234", 1, 3, 60.0,
                                               "10.0.0.2"))]


def test_the_worker_side_hands_the_address_to_the_channel(monkeypatch):
    from eddyrl.hal import weight_channel

    seen = {}

    def connect(platform, rendezvous, rank, world, timeout_s, *, store=None, address=None):
        seen.update(rank=rank, address=address)
        return object()

    monkeypatch.setattr(weight_channel.CollectiveChannel, "connect", staticmethod(connect))
    worker = transfer.WorkerExtension.__new__(transfer.WorkerExtension)
    worker.rank = 1
    worker.eddy_close_weights = lambda: None
    assert worker.eddy_connect_weights("cpu", "tcp://10.0.0.1:1234", 1, 3, 60.0,
                                       "10.0.0.2") == 2
    assert seen == {"rank": 2, "address": "10.0.0.2"}
