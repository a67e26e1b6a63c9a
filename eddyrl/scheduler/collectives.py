"""How long a collective takes over the modelled interconnect: NVLink / HCCS inside a node, each
accelerator's NIC between nodes, at the shares of the link figures that published collective
benchmarks measure (cited where each is defined). The training cost's FSDP all-gathers,
reduce-scatters and HSDP all-reduces (scheduler/train_cost.py) are built from it.

Sans-IO: arithmetic only.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from typing import Literal

from ..validation import check_choice, check_range
from .hardware import Accelerator

Collective = Literal["all_gather", "reduce_scatter", "all_reduce"]

# Inside a node: all_gather bus bandwidth over the link figure of scheduler/hardware.py, by
# ranks in the collective, measured on 8 cards [A13]. NVLink through NVSwitch gives any group
# the full link: A800's 173 of 400 GB/s. Ascend's HCCS is a full mesh of narrow links, so a
# small group reaches only part of it: 910B's 38, 64 and 149 of 196 GB/s on 2, 4 and 8 cards.
_NVSWITCH_ALL_GATHER_SHARE = {8: 173 / 400}
_HCCS_ALL_GATHER_SHARE = {2: 38 / 196, 4: 64 / 196, 8: 149 / 196}
INTRA_NODE_ALL_GATHER_SHARE = {
    **{name: _NVSWITCH_ALL_GATHER_SHARE
       for name in ("H100", "H200", "H800", "H20", "A100", "A800")},
    **{name: _HCCS_ALL_GATHER_SHARE for name in ("910B2", "910B3", "910B4")},
}
# Between nodes: the share of each accelerator's own NIC (400 Gb/s = 50 GB/s) a large NCCL
# collective drives, by payload. Measured as all_reduce over 4 nodes × 8 B200 with one 400 Gb/s
# EFA NIC per accelerator ("the spec for IB NDR400 for this type of a node is 50GBps per
# accelerator as well"), converted to a per-accelerator wire rate: stas00/ml-engineering
# network/README.md, "Inter-node speed depends on intra-node speed" @744d01e, "So what should
# you expect?" table. Taken to hold for all_gather and reduce_scatter (each moves half an
# all_reduce's bytes, in the same ring/hierarchical pattern) and for other 400G fabrics.
NIC_SHARE_BY_PAYLOAD = (  # (payload bytes, share of the NIC's line rate)
    (16 * 2**20, 0.125), (32 * 2**20, 0.176), (64 * 2**20, 0.303), (128 * 2**20, 0.383),
    (256 * 2**20, 0.443), (512 * 2**20, 0.633), (2**30, 0.701), (2 * 2**30, 0.721),
    (4 * 2**30, 0.730), (8 * 2**30, 0.736), (16 * 2**30, 0.739),
)


def nic_share(payload_bytes: float) -> float:
    """The share of a NIC's line rate a collective over `payload_bytes` drives: the measured
    points of NIC_SHARE_BY_PAYLOAD, log-linear between them, flat beyond the ends."""
    sizes = [size for size, _ in NIC_SHARE_BY_PAYLOAD]
    if payload_bytes <= sizes[0]:
        return NIC_SHARE_BY_PAYLOAD[0][1]
    if payload_bytes >= sizes[-1]:
        return NIC_SHARE_BY_PAYLOAD[-1][1]
    upper = bisect_right(sizes, payload_bytes)
    (low_size, low), (high_size, high) = NIC_SHARE_BY_PAYLOAD[upper - 1:upper + 1]
    where = math.log(payload_bytes / low_size) / math.log(high_size / low_size)
    return low + where * (high - low)


def intra_node_share(accelerator: Accelerator, ranks: int) -> float:
    """The share of the intra-node link figure an all_gather over `ranks` devices of one node
    reaches: the measured point for the largest measured group no larger than `ranks`."""
    shares = INTRA_NODE_ALL_GATHER_SHARE.get(accelerator.name, _NVSWITCH_ALL_GATHER_SHARE)
    fitting = [size for size in shares if size <= ranks]
    return shares[max(fitting) if fitting else min(shares)]


def collective_seconds(accelerator: Accelerator, kind: Collective, payload_bytes: float,
                       ranks: int, ranks_per_node: int) -> float:
    """One NCCL-style collective over `ranks` devices, `ranks_per_node` (g) of them on each of
    k nodes. `payload_bytes` (S) is the whole tensor: what an all_gather assembles, what a
    reduce_scatter or an all_reduce reduces. With f = 1 (all_gather, reduce_scatter) or 2
    (all_reduce):

        inside the node : f·(g-1)/g · S / (intra_node_bandwidth · intra_node_share(g))
        between nodes   : f·(k-1)/k · S / g / (inter_node_bandwidth · nic_share(S))
        seconds         = the larger of the two

    Between nodes every accelerator drives its own NIC and each carries 1/g of what crosses
    (hierarchical or multi-ring, as NCCL runs it), so leaving the node costs about 2×, not the
    NVLink/NIC ratio; the measured NIC share already charges the whole elapsed time to the
    NICs, the intra-node phases overlapping it (NIC_SHARE_BY_PAYLOAD's source)."""
    check_choice("collective", kind, ("all_gather", "reduce_scatter", "all_reduce"))
    check_range("payload_bytes", payload_bytes, 0)
    check_range("ranks", ranks, 1)
    check_range("ranks_per_node", ranks_per_node, 1)
    if ranks == 1 or payload_bytes == 0:
        return 0.0
    factor = 2 if kind == "all_reduce" else 1
    per_node = min(ranks, ranks_per_node)
    nodes = -(-ranks // per_node)
    inside = 0.0
    if per_node > 1:
        inside = (factor * (per_node - 1) / per_node * payload_bytes
                  / (accelerator.intra_node_bandwidth * intra_node_share(accelerator, per_node)))
    if nodes == 1:
        return inside
    between = (factor * (nodes - 1) / nodes * payload_bytes / per_node
               / (accelerator.inter_node_bandwidth * nic_share(payload_bytes)))
    return max(inside, between)
