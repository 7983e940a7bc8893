"""What an analysis is: what it reads, what it writes, what it says. Every analysis is declared once,
as an `Analysis`, and listed in `analyses/__init__.py` (ANALYSES); `runner.run` does the rest.

An analysis is a pure function from tables to tables plus a finding:

    ANALYSIS = Analysis(
        name="memory",                       # its findings.json key
        title="Memory per rank and step",    # its report section's heading
        reads=("trace_events", "train_steps"),
        writes={"memory_by_step": MEMORY_BY_STEP},   # typed, documented: schema.table_spec(...)
        compute=memory,                      # Inputs -> Output
        phrase=memory_lines,                 # (its finding, all findings) -> sentences (terminal, summary.md, report.html)
    )

The runner orders analyses by the tables they read and write, gives each an `Inputs` (ingested tables
read with only the needed columns, earlier analyses' outputs, the run facts and options), casts what
it returns to the declared schemas, writes each table and keeps the finding under `name`. Reports
and the terminal render an analysis's tables and sentences in a section of its own, so a new
analysis needs no edit anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import polars as pl
import pyarrow as pa

from steplens.analyze.contract import schema


@dataclass
class Inputs:
    """What an analysis may read. `table` reads an ingested run table (a per-rank table: every rank's
    rows with a `rank` column; only the batch's ranks' when `batch` is set), an earlier analysis's
    output, or an analysis table already written (the per-rank parts), with only the columns asked for."""

    out_dir: Path
    facts: dict
    options: Any  # runner.Options
    ranks: list[int]
    computed: dict[str, pl.DataFrame] = field(default_factory=dict)
    # Set for a per-rank analysis: the ranks it sees, one large rank or a few small ones at a time (every
    # per-rank result is keyed by rank and source, so a batch gives what its ranks give one by one).
    batch: tuple[int, ...] | None = None
    findings: dict = field(default_factory=dict)  # the findings of the analyses run so far
    context: Any = None  # runner.RunContext: the device, its peak and roofline, the world size

    def table(self, name: str, columns: list[str] | None = None, where: pl.Expr | None = None) -> pl.DataFrame:
        if name in self.computed:
            frame = self.computed[name].lazy()  # lazy: only the columns asked for are filtered
            frame = frame.filter(where) if where is not None else frame
            return (frame.select(columns) if columns else frame).collect()
        ingested = name in schema.TABLES
        if not (self.out_dir / name).exists():
            return _empty(name, columns) if ingested else pl.DataFrame()
        partitioned = ingested and schema.TABLES[name][2]
        frame = pl.scan_parquet(self.out_dir / name, hive_partitioning=partitioned)
        if self.batch is not None and partitioned:
            frame = frame.filter(pl.col("rank").is_in(self.batch))
        if where is not None:
            frame = frame.filter(where)
        return (frame.select(columns) if columns else frame).collect()

    def parts(self, name: str, columns: list[str]) -> Iterator[pl.DataFrame]:
        """A per-rank analysis table as written, one part at a time (a batch of whole ranks each: Analysis.parts),
        with only the columns asked for: memory bounded by the largest part, not the run."""
        for path in sorted((self.out_dir / name).glob("*.parquet")):
            yield pl.read_parquet(path, columns=columns, glob=False)  # a folder name may hold [ ] * ?


def _empty(name: str, columns: list[str] | None) -> pl.DataFrame:
    """The typed empty frame of an ingested table (a run without traces has no per-rank tables)."""
    frame = pl.from_arrow(schema.TABLES[name][0].empty_table())
    if schema.TABLES[name][2]:
        frame = frame.with_columns(rank=pl.lit(None, pl.Int64))
    return frame.select(columns) if columns else frame


@dataclass
class Output:
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)  # declared outputs and passed results
    finding: dict | list | None = None  # findings.json[name]; None: nothing to say
    # Further findings.json keys beside it, each named `<name>_<qualifier>` (mfu's figures are a list, so what
    # qualifies them sits beside them: mfu_refused, mfu_numerators_disagree).
    qualified: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Analysis:
    name: str
    title: str
    reads: tuple[str, ...]
    writes: dict[str, tuple[pa.Schema, dict[str, str]]]
    compute: Callable[[Inputs], Output]
    # Its finding (and the run's findings, for what qualifies it) -> sentences: terminal, summary.md, report.html.
    phrase: Callable[[Any, dict], list[str]] = lambda finding, findings: []
    # Its report section(s): (page, run) -> a section (or a list, or None: nothing to show) built with
    # page.section(title, anchor) from the run's tables and findings, its text, figures and tables in order;
    # reports/html.py's PAGE formats and draws them. None: the analysis shows no section of its own.
    section: Callable[[Any, Any], Any] | None = None
    # What the first screen says of the finding when it is a problem, in one short line (None: nothing wrong).
    headline: Callable[[dict | list], str | None] = lambda finding: None
    # Per-rank analyses run before any run-level one, over one batch of ranks at a time (runner.batches),
    # reading only those ranks' rows; their outputs are concatenated over ranks, except `parts`, written
    # batch by batch as part-<first rank> and never held for all ranks at once (the large per-rank tables).
    per_rank: bool = False
    parts: tuple[str, ...] = ()
    # Results later analyses read that are not tables of their own (kept in memory, never written).
    passes: tuple[str, ...] = ()
    # findings.json keys of steplens 0.1 that this finding replaces, still written for users' scripts until 0.3:
    # old key -> the key inside this finding holding its value (None: the whole finding). README: findings.json.
    former_keys: dict[str, str | None] = field(default_factory=dict)

    def __post_init__(self):
        if clash := set(self.writes) & set(schema.TABLES):
            raise ValueError(f"analysis {self.name}: output tables {sorted(clash)} are ingested tables")
        if stray := set(self.parts) - set(self.writes):
            raise ValueError(f"analysis {self.name}: parts {sorted(stray)} are not among its outputs")


def ordered(analyses: list[Analysis]) -> list[Analysis]:
    """Per-rank analyses first, then the run-level ones, each after those whose outputs it reads."""
    producer: dict[str, str] = {}
    for analysis in analyses:
        for table in [*analysis.writes, *analysis.passes]:
            if table in producer:
                raise ValueError(f"{table} is produced by both {producer[table]} and {analysis.name}")
            producer[table] = analysis.name
    done: list[Analysis] = []
    for stage in ([a for a in analyses if a.per_rank], [a for a in analyses if not a.per_rank]):
        pending = list(stage)
        while pending:
            finished = {d.name for d in done}
            ready = [a for a in pending if all(producer.get(t) in (None, a.name) or producer[t] in finished for t in a.reads)]
            if not ready:
                raise ValueError(f"analyses whose inputs are never produced before them: {[a.name for a in pending]}")
            done.extend(ready)
            pending = [a for a in pending if a not in ready]
    return done


def conformed(frame: pl.DataFrame, spec: tuple[pa.Schema, dict[str, str]], table: str) -> pl.DataFrame:
    """`frame` with exactly the declared columns, in order and type (an empty result: typed and empty)."""
    return pl.from_arrow(conformed_arrow(frame, spec, table))


def conformed_arrow(frame: pl.DataFrame, spec: tuple[pa.Schema, dict[str, str]], table: str) -> pa.Table:
    """conformed, as the Arrow table that is written (cast once: the Parquet writer takes it as it is)."""
    arrow_schema = spec[0]
    if frame.is_empty():
        return arrow_schema.empty_table()
    if missing := [name for name in arrow_schema.names if name not in frame.columns]:
        raise KeyError(f"analysis table {table} lacks columns {missing}")
    return frame.select(arrow_schema.names).to_arrow().cast(arrow_schema)
