"""Run every analysis over a run directory's tables and write each result as its own Parquet table.

The analyses are declared, each in its module, and listed in analyses/__init__.py (ANALYSES);
this module orders them by what they read, runs the per-rank ones a batch of ranks at a time (only
those ranks' rows in memory: one large rank, or a few small ones), then the run-level ones, writes
every output typed as declared and gathers the findings into findings.json.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass, field, replace
from collections import Counter
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from steplens.analyze.analyses import ANALYSES, devices, kernels, mfu, op_perf, registry
from steplens.analyze.analyses.registry import Analysis, Inputs
from steplens.analyze.contract import schema
from steplens.analyze.contract.manifest import process_count, run_facts

@dataclass
class Options:
    dtype: str | None = None  # None: the run's (mfu.compute_dtype)
    peak_tflops: float | None = None
    shape: dict | None = None  # the model's shape as given on the command line (mfu.SHAPE_FIELDS), any part
    recompute: bool = False
    kernel_categories: list = field(default_factory=lambda: list(kernels.KERNEL_CATEGORIES))
    grad_norm_threshold: float | None = None


@dataclass
class RunContext:
    """What every analysis may need to know about the run's hardware."""

    device_name: str | None
    num_sms: int | None
    device_key: str | None  # the device's row in the peak table
    roof: op_perf.Roof
    peak: mfu.Peak | None
    peak_problem: str | None
    world_size: int  # manifest.process_count: the run's world size, else its traced ranks
    device_activity: bool | None = None  # whether the traces hold device work; None without traces
    runtime_calls: int = 0  # CUDA/HIP runtime and driver calls in the traces (launches among them)
    backend: str | None = None  # the process group backend the traces record (distributedInfo.backend)
    # rank -> the world size its trace records (distributedInfo.world_size); ranks without one are absent
    world_size_of_rank: dict = field(default_factory=dict)
    # rank -> the trace file it came from, for the ranks that share one (one Nsight Systems export of several
    # processes: one host's clock)
    file_of_rank: dict = field(default_factory=dict)
    dtype_origin: str = ""  # where the peak's dtype came from (mfu.compute_dtype), once the per-rank analyses ran


def _device(manifest: dict) -> tuple[str | None, int | None]:
    """The run's GPU model. Kineto lists every GPU of the node; a mixed node has no single peak."""
    env = manifest.get("environment", {})
    names, sms = env.get("device_names") or [], env.get("device_sms") or []
    if not names and not manifest.get("trace_ranks"):  # no traces: the GPUs the collector saw (its manifest's host block)
        hosts = [v.get("host") for k, v in manifest.get("facts", {}).items() if k.startswith("collector_rank")
                 and isinstance(v, dict) and isinstance(v.get("host"), dict)]
        names = sorted({d for h in hosts if isinstance(h.get("devices"), list) for d in h["devices"]
                        if isinstance(d, str) and not d.lower().startswith("cpu")})
    if len(names) != 1:
        return None, None
    return names[0], sms[0] if len(sms) == 1 else None


def _world_size_of_rank(manifest: dict) -> dict[int, int]:
    """The world size each rank's trace records (run.json sources: only a trace's has one)."""
    return {s["rank"]: s["world_size"] for s in manifest.get("sources", []) if isinstance(s, dict)
            and s.get("rank") is not None and s.get("world_size") and s.get("status") in ("ingested", "reused")}


def _shared_files(manifest: dict) -> dict[int, str]:
    """rank -> its trace file, for the ranks whose file holds other ranks too (each a `unit` of it)."""
    files = {s["rank"]: s.get("path") for s in manifest.get("sources", []) if isinstance(s, dict) and s.get("unit")
             and s.get("rank") is not None and s.get("status") in ("ingested", "reused")}
    ranks_in = Counter(files.values())
    return {rank: path for rank, path in files.items() if path is not None and ranks_in[path] > 1}


def _write(out_dir: Path, table: str, frame: pl.DataFrame, spec, part: str = "part-0") -> pl.DataFrame:
    """Write `frame` typed as declared (an analysis with nothing to say: empty and typed, so SQL over it
    works; a value that does not fit its type raises here); returns what was written."""
    typed = registry.conformed_arrow(frame, spec, table)
    folder = out_dir / table
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{part}.parquet.tmp"
    # No dictionary pages: zstd alone packs these tables smaller and writes them faster (op_perf: 185 kB
    # against 290 kB and 16 ms against 21 ms for one real A100 rank's 36k ops).
    pq.write_table(typed, tmp, compression="zstd", compression_level=1, use_dictionary=False,
                   write_statistics=schema.text_columns(typed.schema)[1])
    tmp.replace(folder / f"{part}.parquet")
    return pl.from_arrow(typed)


def _mixed_devices(manifest: dict) -> str | None:
    """Why a run whose traces name several device models has no one peak (None when they name one or none)."""
    names = manifest.get("environment", {}).get("device_names") or []
    if len(names) < 2:
        return None
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"the traces name {len(names)} device models ({shown}), so the run has no one peak"


def _kind_count(manifest: dict, kind: str) -> int:
    return sum(s["kind_counts"].get(kind, 0) for s in manifest.get("sources", [])
               if isinstance(s, dict) and isinstance(s.get("kind_counts"), dict))


def _device_activity(manifest: dict) -> bool | None:
    """Whether the run's traces hold any device work; None when it has no traces."""
    counts = [s["kind_counts"] for s in manifest.get("sources", []) if isinstance(s, dict) and s.get("kind_counts")]
    if not counts:
        return None
    return any(c.get(kind, 0) for c in counts for kind in schema.DEVICE_KINDS)


def rank_analyses(batch: tuple[int, ...], *, out_dir: Path, facts: dict, options: Options, ranks: list[int],
                  context: RunContext) -> dict[str, list[pl.DataFrame]]:
    """The per-rank analyses of one batch of ranks: its per-rank parts written to out_dir, the frames to
    gather across ranks returned (under `analyze --scheduler`, a task on a worker that sees out_dir)."""
    gathered: dict[str, list[pl.DataFrame]] = {}
    inputs = Inputs(out_dir, facts, options, ranks, batch=tuple(batch), context=context)
    for analysis in [a for a in registry.ordered(ANALYSES) if a.per_rank]:
        result = analysis.compute(inputs)
        for table, spec in analysis.writes.items():
            frame = result.tables.get(table, pl.DataFrame())
            if table in analysis.parts:
                inputs.computed[table] = _write(out_dir, table, frame, spec, part=f"part-{batch[0]}")
            else:
                inputs.computed[table] = frame
                gathered.setdefault(table, []).append(frame)
        for name in analysis.passes:
            inputs.computed[name] = result.tables[name]
            gathered.setdefault(name, []).append(result.tables[name])
    return gathered


# A batch of per-rank analyses holds at most this many trace events (or one rank, if larger): a query
# costs about 0.2 ms however small its input, and the per-rank analyses run about 200 of them, so a
# small rank (a few thousand events) is mostly that fixed cost; batched, its ranks share it. Memory stays
# bounded by the largest rank or this, whichever is more, not by the number of ranks.
RANK_BATCH_EVENTS = 100_000


def batches(manifest: dict, ranks: list[int], limit: int | None = None) -> list[tuple[int, ...]]:
    """The ranks in order, in consecutive batches of at most `limit` trace events (one rank alone if larger)."""
    limit = RANK_BATCH_EVENTS if limit is None else limit
    events = dict.fromkeys(ranks, 0)
    for source in manifest.get("sources", []):
        if isinstance(source, dict) and source.get("rank") in events and isinstance(source.get("events"), int):
            events[source["rank"]] += source["events"]
    grouped: list[list[int]] = []
    held = 0
    for rank in ranks:
        size = max(events[rank], 1)  # a rank whose size is unknown still counts
        if not grouped or held + size > limit:
            grouped.append([])
            held = 0
        grouped[-1].append(rank)
        held += size
    return [tuple(batch) for batch in grouped]


def run(out_dir: Path, options: Options | None = None, map_ranks=None) -> dict:
    """All analyses over out_dir; returns the findings (also written to findings.json). `map_ranks`
    (like the built-in map, the default) runs the per-rank analyses over the batches of ranks, in order."""
    options = options or Options()
    manifest = json.loads((out_dir / schema.MANIFEST_FILE).read_text())
    ranks = manifest["trace_ranks"]
    facts = run_facts(manifest)
    device_name, num_sms = _device(manifest)
    device_activity = _device_activity(manifest)
    roof, mixed = op_perf.device_roof(device_name, num_sms), _mixed_devices(manifest)
    if device_activity is None:  # the ops and their device time come from the traces
        roof = op_perf.Roof(problem="no roofline: no profiler traces")
    elif device_activity is False:
        roof = op_perf.Roof(problem="no roofline: the traces hold no GPU work")
    elif mixed:
        roof = op_perf.Roof(problem=f"no roofline: {mixed}")
    context = RunContext(device_name, num_sms, devices.match_device(device_name, num_sms) if device_name else None,
                         roof, None, None, process_count(manifest), device_activity,
                         _kind_count(manifest, "cuda_runtime") + _kind_count(manifest, "cuda_driver"),
                         ", ".join(manifest.get("environment", {}).get("backend") or []) or None,
                         _world_size_of_rank(manifest), _shared_files(manifest))
    ordered = registry.ordered(ANALYSES)
    for analysis in ordered:
        for table in analysis.writes:
            shutil.rmtree(out_dir / table, ignore_errors=True)

    per_rank = [a for a in ordered if a.per_rank]
    gathered: dict[str, list[pl.DataFrame]] = {}
    one_batch = functools.partial(rank_analyses, out_dir=Path(out_dir).resolve(), facts=facts, options=options,
                                  ranks=ranks, context=context)
    for frames in (map_ranks or map)(one_batch, batches(manifest, ranks)):  # in rank order, however they ran
        for name, parts in frames.items():
            gathered.setdefault(name, []).extend(parts)

    computed = {name: pl.concat(frames, how="diagonal_relaxed") for name, frames in gathered.items()}
    # the peak's dtype: the traces' innermost ops say it best, so it is known only now
    dtype, dtype_origin = mfu.compute_dtype(options.dtype, computed.get("_dtype_flops", pl.DataFrame()), facts,
                                            context.device_key, mfu.tf32_gemm_share(computed.get("_kernel_totals", pl.DataFrame())))
    options = replace(options, dtype=dtype)
    peak, peak_problem = mfu.peak_for(device_name, dtype, num_sms, options.peak_tflops, device_activity, dtype_origin)
    if mixed and peak is None:
        peak_problem = f"{mixed}; pass --peak-tflops (dense, per GPU) to compute MFU"
    context = replace(context, peak=peak, peak_problem=peak_problem, dtype_origin=dtype_origin)
    findings: dict = {"device": device_name if ranks else None}
    inputs = Inputs(out_dir, facts, options, ranks, computed=computed, findings=findings, context=context)
    for analysis in per_rank:
        for table, spec in analysis.writes.items():
            if table not in analysis.parts or not ranks:
                computed[table] = _write(out_dir, table, computed.get(table, pl.DataFrame()), spec)
    for analysis in ordered:
        if analysis.per_rank:
            continue
        result = analysis.compute(inputs)
        for table, spec in analysis.writes.items():
            computed[table] = _write(out_dir, table, result.tables.get(table, pl.DataFrame()), spec)
        for name in analysis.passes:
            computed[name] = result.tables[name]
        if stray := [key for key in result.qualified if not key.startswith(f"{analysis.name}_")]:
            raise ValueError(f"analysis {analysis.name}: findings {stray} do not carry its name")
        findings.update(result.qualified)
        if result.finding is not None:
            findings[analysis.name] = result.finding
    findings.update(former_keys(ordered, findings))
    (out_dir / schema.FINDINGS_FILE).write_text(json.dumps(findings, indent=1, default=str))
    return findings


def former_keys(analyses: list[Analysis], findings: dict) -> dict:
    """The findings.json keys earlier versions wrote, from the findings that replace them (after every analysis
    ran: sanity's corrections included)."""
    former = {}
    for analysis in analyses:
        finding = findings.get(analysis.name)
        for old, inner in analysis.former_keys.items():
            if inner is None and finding is not None:
                former[old] = finding
            elif isinstance(finding, dict) and inner in finding:  # None too, as 0.1 wrote it
                former[old] = finding[inner]
    return former
