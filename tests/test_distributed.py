"""The run layout read unchanged by a distributed engine (Dask, local scheduler): one of the
analyses' questions, GPU time per rank and kernel category, gives the same answer as DuckDB."""

import duckdb
import pytest

from steplens.analyze.pipeline import analyse
from synthetic import generate_run

dd = pytest.importorskip("dask.dataframe")


def test_dask_reads_the_run_layout_unchanged(tmp_path):
    run = tmp_path / "run"
    generate_run(run, ranks=4, steps=3, seed=2)
    analyse(run, jobs=1)
    out = run / ".steplens"

    # Per-rank table, hive-partitioned by rank: Dask finds the rank column in the paths.
    events = dd.read_parquet(str(out / "trace_events"), columns=["kind", "dur_ns", "rank"])
    kernels = events[events["kind"] == "kernel"].groupby("rank")["dur_ns"].sum().compute()
    expected = dict(duckdb.sql(
        f"SELECT rank, sum(dur_ns) FROM read_parquet('{out}/trace_events/*/*.parquet', hive_partitioning=true) "
        "WHERE kind = 'kernel' GROUP BY rank").fetchall())
    assert {int(r): int(v) for r, v in kernels.items()} == expected and len(expected) == 4

    # Run-level analysis table.
    categories = dd.read_parquet(str(out / "kernel_categories")).groupby("category")["time_ns"].sum().compute()
    expected = dict(duckdb.sql(f"SELECT category, sum(time_ns) FROM '{out}/kernel_categories/*.parquet' GROUP BY ALL").fetchall())
    assert {k: int(v) for k, v in categories.items()} == expected
