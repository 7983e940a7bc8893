"""nccl-tests bus bandwidth: the one formula the collector and the analyzer both apply.

Source: NVIDIA/nccl-tests doc/PERFORMANCE.md ("Bus bandwidth") and src/*.cu `*GetBw`. algbw = S / t (GB/s = 1e9 bytes/s) and
busbw = algbw x factor, where the factor depends on the collective and n, the process group's size:

    allreduce                                          2(n-1)/n
    allgather, reducescatter, alltoall, gather, scatter  (n-1)/n
    broadcast, reduce, sendrecv                        1

`op` is the collective in nccl-tests terms (the names above); any other op has no factor (null), and neither has a
group of one rank: nothing crosses a link (nccl-tests' factors give 0 or, for broadcast, the local copy rate).
"""

from __future__ import annotations

import polars as pl

ALLREDUCE_OPS = ("allreduce",)
RING_OPS = ("allgather", "reducescatter", "alltoall", "gather", "scatter")  # (n-1)/n
UNIT_FACTOR_OPS = ("broadcast", "reduce", "sendrecv")  # 1


def busbw_factor() -> pl.Expr:
    """Bus-bandwidth factor of each row from its `op` and `group_size` columns; null for an unknown op
    or a group of fewer than two ranks."""
    n = pl.col("group_size").cast(pl.Float64)
    ring = (n - 1) / n
    return (
        pl.when(pl.col("group_size") <= 1).then(None)
        .when(pl.col("op").is_in(ALLREDUCE_OPS)).then(2 * ring)
        .when(pl.col("op").is_in(RING_OPS)).then(ring)
        .when(pl.col("op").is_in(UNIT_FACTOR_OPS)).then(1.0)
    )
