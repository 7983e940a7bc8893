"""nccl-tests bus bandwidth: the one formula the collector and the analyzer both apply.

Source: NVIDIA/nccl-tests doc/PERFORMANCE.md ("Bus bandwidth") and src/*.cu `*GetBw`. algbw = S / t (GB/s = 1e9 bytes/s) and
busbw = algbw x factor, where the factor depends on the collective and n, the process group's size:

    allreduce                                          2(n-1)/n
    allgather, reducescatter, alltoall, gather, scatter  (n-1)/n
    broadcast, reduce, sendrecv                        1

`op` is the collective in nccl-tests terms (the names above); any other op has no factor (null), and neither has a
group of one rank: nothing crosses a link (nccl-tests' factors give 0 or, for broadcast, the local copy rate).

Also here, once for the collector, the importers and the analyses: a collective's name in nccl-tests terms
(`nccl_tests_op`, from an NCCL kernel's, a c10d / record_param_comms or a DeepSpeed op's name), and nccl-tests'
message size S (`with_bandwidth`): S is the whole buffer of the collective, so for the ops whose logged size is
one rank's piece (all-gather's shard, gather's and scatter's local piece: DeepSpeed's get_msg_size_from_args
takes the `tensor` argument) S = piece x n (nccl-tests src/all_gather.cu, gather.cu, scatter.cu `*GetBw`:
baseBw = count x typesize x nranks / time). reduce_scatter's logged input is already the whole buffer.
"""

from __future__ import annotations

import polars as pl

ALLREDUCE_OPS = ("allreduce",)
RING_OPS = ("allgather", "reducescatter", "alltoall", "gather", "scatter")  # (n-1)/n
UNIT_FACTOR_OPS = ("broadcast", "reduce", "sendrecv")  # 1
PER_RANK_PIECE_OPS = ("allgather", "gather", "scatter")  # logged size x n = nccl-tests' S

# (nccl-tests name, regex), first match wins: reduce_scatter before reduce, all_gather before gather.
COLLECTIVE_NAMES = [
    ("reducescatter", r"(?i)reduce_?scatter"),
    ("allreduce", r"(?i)all_?reduce|cross_device_reduce"),
    ("allgather", r"(?i)all_?gather"),
    # DeepEP's dispatch/combine kernels are the two halves of an MoE all-to-all
    ("alltoall", r"(?i)all_?to_?all|(^|::)(notify_|cached_notify_?)?(dispatch|combine)(_ll)?\b"),
    ("broadcast", r"(?i)broadcast"),
    ("sendrecv", r"(?i)send|recv"),
    ("reduce", r"(?i)reduce"),
    ("gather", r"(?i)gather"),
    ("scatter", r"(?i)scatter"),
    ("barrier", r"(?i)barrier"),
]


def nccl_tests_op(column: str) -> pl.Expr:
    """A collective's name (NCCL kernel, record_param_comms, c10d or DeepSpeed op) in nccl-tests terms; null
    for a name that is no collective."""
    expr = pl.when(pl.lit(False)).then(pl.lit(None, pl.String))
    for name, pattern in COLLECTIVE_NAMES:
        expr = expr.when(pl.col(column).str.contains(pattern)).then(pl.lit(name))
    return expr.otherwise(pl.lit(None, pl.String))


def with_bandwidth(calls: pl.DataFrame) -> pl.DataFrame:
    """nccl_bytes (nccl-tests' S), algbw_gbps and busbw_gbps of each logged call, from its `op` (any name
    nccl_tests_op knows), `msg_bytes` (the size DeepSpeed logs), `group_size` and `latency_ns`."""
    named = calls.with_columns(_nccl_op=nccl_tests_op("op"))
    named = named.with_columns(nccl_bytes=pl.when(pl.col("_nccl_op").is_in(PER_RANK_PIECE_OPS))
                               .then(pl.col("msg_bytes") * pl.col("group_size")).otherwise(pl.col("msg_bytes")))
    factor = named.select(op=pl.col("_nccl_op"), group_size=pl.col("group_size")).select(factor=busbw_factor())["factor"]
    algbw = pl.when(pl.col("latency_ns") > 0).then(pl.col("nccl_bytes") / pl.col("latency_ns"))  # B/ns = GB/s
    return named.with_columns(algbw_gbps=algbw).with_columns(busbw_gbps=pl.col("algbw_gbps") * factor).drop("_nccl_op")


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
