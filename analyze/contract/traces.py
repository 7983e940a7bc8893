"""The trace model: what a trace importer returns and what ingest makes of it.

A trace importer is one module under `importers/` registered by one line in `importers/__init__.py`
(`TraceImporter`). It defines `claims(path) -> bool` and `decode(path) -> DecodedTrace` (a list of
them for a file of several ranks), and optionally `settings() -> str`. It only decodes: events with
the trace-event columns of `schema.TRACE_EVENTS` (without the step, launch and source columns), flow
endpoints, and the trace's facts as a typed `TraceMeta` (never its format's own key names). Ingest
applies `trace/semantics.py` (steps, launch links, flows) and stamps the source on every row, the
same way for every format (`ParsedTrace`).

This module imports nothing heavy: the registry is read before polars is imported, to decide
whether to start worker processes early.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from steplens.analyze.contract.issue_reasons import Issue

if TYPE_CHECKING:
    import polars as pl

INT64_RANGE = (-(1 << 63), (1 << 63) - 1)
META_TEXT_CHARS = 200  # a version string or a backend name; longer text is cut
# A trace's times are int64 ns: bounding |ts| and |dur| by 2**62 ns (146 years; epoch ns today are 1.8e18) keeps
# ts + dur and ts + a base time inside int64, so no end time can wrap. Beyond it a time is damage, not a measurement.
TIME_LIMIT_NS = 2**62


class NotATrace(Exception):
    """The file is readable but is not a trace of the importer's format; the message says what it looks like.

    `damaged`: it is not even a file of that kind (JSON that is not JSON, a SQLite file that cannot be
    opened, a trace cut short before its events), as opposed to a valid file of another kind (a
    ds_config.json, a SQLite database of another program)."""

    def __init__(self, message: str, damaged: bool = False):
        super().__init__(message)
        self.damaged = damaged


@dataclass
class Device:
    """One accelerator as its trace describes it (feeds the peak table by name)."""

    name: str | None = None
    sm_count: int | None = None
    memory_bytes: int | None = None
    clock_khz: int | None = None


@dataclass
class TraceMeta:
    """What a trace says about its run, whatever its format. Absent is None; a value of the wrong type or
    out of range is None too, named in `problems` (ingest reports them as one bad_metadata issue)."""

    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None  # the process group's (nccl, gloo, ...)
    nccl_version: int | str | None = None
    pg_count: int | None = None
    devices: list[Device] = field(default_factory=list)
    schema_version: int | str | None = None  # of the trace format
    producer_version: str | None = None  # of the program that wrote it (Nsight Systems' version)
    cuda_runtime_version: int | str | None = None
    cuda_driver_version: int | str | None = None
    base_time_ns: int | None = None  # the epoch ns that relative timestamps were written against
    display_time_unit: str | None = None
    problems: list[str] = field(default_factory=list)


def checked(value, name: str, problems: list[str], kinds, bounds: tuple[int, int] = INT64_RANGE):
    """`value` when it is one of `kinds` (an int within `bounds`, a string cut to META_TEXT_CHARS, a dict),
    else None with `name = value` added to `problems`. None stays None."""
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if value is None:
        return None
    if type(value) is int and int in kinds and bounds[0] <= value <= bounds[1]:
        return value
    if isinstance(value, str) and str in kinds:
        return value[:META_TEXT_CHARS]
    if isinstance(value, dict) and dict in kinds:
        return value
    problems.append(f"{name} = {preview(value)}")
    return None


def preview(value) -> str:
    """A short, printable rendering of a value from an input (repr escapes control characters)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)} items"
    return repr(value)[:80]


@dataclass
class DecodedTrace:
    """What a trace importer returns for one file (or, for a file of several ranks, for one of them)."""

    events: pl.DataFrame  # schema.TRACE_EVENTS columns but step, is_launch, launch_event_id and source
    endpoints: pl.DataFrame  # flow endpoints: ph, cat, pid, tid, ts_ns, flow_id (empty when the format has none)
    meta: TraceMeta
    issues: list[Issue] = field(default_factory=list)
    raw_bytes: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)  # seconds per decode stage, for the benchmark
    # Which part of its file this is, when the file holds several ranks (an nsys export of several processes).
    unit: str = ""
    step_name: re.Pattern | None = None  # host ranges that are steps; None: semantics.STEP_NAME (ProfilerStep#N)


@dataclass
class ParsedTrace:
    """One rank's trace tables, as ingest stores them: trace_events, flows, steps, each row with its source."""

    events: pl.DataFrame
    flows: pl.DataFrame
    steps: pl.DataFrame
    meta: TraceMeta
    issues: list[Issue] = field(default_factory=list)
    raw_bytes: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    unit: str = ""


@dataclass(frozen=True)
class TraceImporter:
    """One trace format: the module `steplens.analyze.importers.<name>`, imported when a file needs it.
    `names`: the file-name endings it may read (lower case), which also decide before any import whether a
    run folder holds traces enough to start workers for."""

    name: str  # the module, and the source kind recorded in run.json
    names: tuple[str, ...]

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"steplens.analyze.importers.{self.name}")

    def claims(self, path: Path) -> bool:
        return path.name.lower().endswith(self.names) and self.module.claims(path)

    def decode(self, path: Path) -> DecodedTrace | list[DecodedTrace]:
        return self.module.decode(path)

    def settings(self) -> str:
        """What else its result depends on (an option, such as nsys's step-range pattern): parts decoded
        under other settings are not reused."""
        return getattr(self.module, "settings", lambda: "")()
