"""Which rank and which step is slow: step times per rank, clock offsets, stragglers.

Ranks' clocks are never assumed to agree. Each rank's offset to the reference rank (the lowest rank)
is estimated from the END times of the same collective instance on both ranks: a collective
completes on every member at nearly the same moment, whatever time each rank arrived. The estimate
is the median of the per-instance differences; its uncertainty is half their range.

A straggler is the rank the others wait for: the last to arrive at the step's collectives. Each
rank's wait in one collective instance is its kernel time minus the shortest kernel time of that
instance over ranks (the transfer itself). Without collective timing (gloo/CPU runs, no communication
kernels) no straggler is named: in a synchronous job every rank ends a step with its last collective, so the
rank with the longest step is the one that began it first and waited, as often as the one that was late.

The candidate is called a straggler only when it stands out from the run's own noise, and
`straggler_basis` says which test decided it (each also needs the lateness to be at least
STRAGGLER_MIN_SHARE of the step, so a µs-level lead is never a finding):

* ``same_rank_last``: one rank is the candidate in so many of the steps that chance (each of R ranks
  last with probability 1/R) explains it with a one-sided binomial p below ALPHA;
* ``beyond_rank_spread`` (3 ranks or more): its lead over the next-latest rank exceeds 3.5 x the
  spread of the other ranks (MAD / 0.6745, the modified z-score of Iglewicz & Hoaglin);
* ``beyond_step_noise`` (any number of ranks, at least MIN_NOISE_STEPS steps): the others waited
  for it in this step over 3.5 x longer than in any other step of the run, i.e. a wait well beyond
  the spread between ranks when nobody straggles (waits between ranks are heavy-tailed, so the
  largest other wait, not a median, is the noise it must clear).

Ranks taking turns at being last (noise) pass none of them.
"""

from __future__ import annotations

import math

import polars as pl
import pyarrow as pa

from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.contract.units import duration
from steplens.analyze.contract import schema

# A step has a straggler when the other ranks waited for it, on median, at least this share of the
# step's median duration; below it, "last to arrive" is jitter.
STRAGGLER_MIN_SHARE = 0.05
ALPHA = 0.05  # noise.ALPHA: one significance level for every test steplens runs
MAD_Z_SCALE, OUTLIER_Z = 0.6745, 3.5
MIN_NOISE_STEPS = 4  # below this a step's wait has too few others to be judged against


def clock_offsets(calls: pl.DataFrame, ranks: list[int], world_sizes: dict[int, int] | None = None,
                  steps: pl.DataFrame | None = None, files: dict[int, str] | None = None) -> pl.DataFrame:
    """offset_ns per rank: add it to the reference rank's clock to get this rank's (aligned = ts - offset).
    A rank that cannot be one job with the reference rank (`unalignable`) gets no offset and says why. Ranks from
    one trace file (`files`: rank -> file, for the files of several ranks) were recorded on one clock."""
    offsets = _one_clock_per_file(_estimated_offsets(calls, ranks), files or {})
    refusals = unalignable(offsets, world_sizes or {}, steps)
    if not refusals:
        return offsets
    refused = pl.DataFrame({"rank": list(refusals), "refusal": list(refusals.values())},
                           schema={"rank": pl.Int64, "refusal": pl.String})
    return offsets.join(refused, on="rank", how="left").with_columns(
        offset_ns=pl.when(pl.col("refusal").is_null()).then(pl.col("offset_ns")),
        uncertainty_ns=pl.when(pl.col("refusal").is_null()).then(pl.col("uncertainty_ns")),
        method=pl.coalesce(pl.lit(REFUSED_PREFIX) + pl.col("refusal"), pl.col("method")),
    ).select(offsets.columns)


# The method of a rank whose alignment was refused starts with this; the reason follows.
REFUSED_PREFIX = "refused: "


def refused_ranks(offsets: pl.DataFrame) -> list[int]:
    """The ranks clock_offsets refused as ranks of this job (unalignable), in order."""
    if offsets.is_empty():
        return []
    return sorted(offsets.filter(pl.col("method").str.starts_with(REFUSED_PREFIX))["rank"].to_list())


def unalignable(offsets: pl.DataFrame, world_sizes: dict[int, int], steps: pl.DataFrame | None) -> dict[int, str]:
    """rank -> why its trace cannot be put on the reference rank's clock as a rank of the same job.

    * World size: torch.distributed gives every rank of a job the same world size, and the profiler
      records it in distributedInfo (torch/profiler/profiler.py, _get_distributed_info); two traces
      recording different ones are ranks of different jobs.
    * Clock: a collective ends at nearly the same moment on every member, so in one job the
      per-instance end-time differences agree to the collective's end skew (µs on real ranks: 3.5 µs
      over 8 dlrm V100 ranks) and the offset is known far better than a step. An offset whose
      uncertainty exceeds the shorter median profiled step of the two ranks matched collectives of
      different steps or of different jobs: the aligned steps would be fiction. The size of the offset
      itself is no criterion: ranks on different hosts may count from different boots.
    Host names are not a criterion: Kineto traces do not record them."""
    reference = offsets.filter(pl.col("method") == "reference")
    if reference.is_empty():
        return {}
    ref = reference["rank"][0]
    step_ns = {}
    if steps is not None and not steps.is_empty():
        durations = steps.group_by("rank", "step").agg(dur=pl.col("end_ns").max() - pl.col("start_ns").min())
        medians = durations.group_by("rank").agg(pl.col("dur").median())
        step_ns = dict(medians.iter_rows())  # rowwise-ok: one row per rank
    refusals = {}
    for rank, offset_ns, uncertainty_ns in offsets.select("rank", "offset_ns", "uncertainty_ns").iter_rows():  # rowwise-ok
        if rank == ref:
            continue
        size, ref_size = world_sizes.get(rank), world_sizes.get(ref)
        if size is not None and ref_size is not None and size != ref_size:
            refusals[rank] = f"its trace records world size {size}, rank {ref}'s {ref_size}: ranks of different jobs"
        elif offset_ns is not None and rank in step_ns and ref in step_ns:
            step = min(step_ns[rank], step_ns[ref])
            if uncertainty_ns > step:
                refusals[rank] = (f"offset {offset_ns / 1e9:,.3f} s known only to ± {uncertainty_ns / 1e6:,.1f} ms, more "
                                  f"than a step ({step / 1e6:,.1f} ms): its collectives do not end with rank {ref}'s, "
                                  "so they are not one job's")
    return refusals


def _one_clock_per_file(offsets: pl.DataFrame, files: dict[int, str]) -> pl.DataFrame:
    """Ranks of one file (an Nsight Systems export of one host's processes) share one clock: the file's ranks get
    one offset, 0 with the reference rank among them, else the median of their estimates (each measures the same
    offset), not each its own collectives' skew."""
    if not files or offsets.is_empty():
        return offsets
    reference = offsets["reference_rank"][0]
    by_file = pl.DataFrame({"rank": list(files), "file": list(files.values())}, schema={"rank": pl.Int64, "file": pl.String})
    grouped = offsets.join(by_file, on="rank", how="left").with_columns(
        has_reference=(pl.col("rank") == reference).any().over("file"),
        file_offset=pl.col("offset_ns").median().over("file").round().cast(pl.Int64),
        file_uncertainty=pl.col("uncertainty_ns").max().over("file"))
    shared = pl.col("file").is_not_null() & (pl.col("rank") != reference)
    return grouped.with_columns(
        offset_ns=pl.when(shared & pl.col("has_reference")).then(0).when(shared).then("file_offset")
        .otherwise("offset_ns"),
        uncertainty_ns=pl.when(shared & pl.col("has_reference")).then(0).when(shared).then("file_uncertainty")
        .otherwise("uncertainty_ns"),
        method=pl.when(shared & pl.col("has_reference")).then(pl.lit("one clock with the reference rank (same file)"))
        .when(shared & pl.col("file_offset").is_not_null())
        .then(pl.lit("collective end times, one clock for the ranks of its file"))
        .otherwise("method")).select(offsets.columns)


def _estimated_offsets(calls: pl.DataFrame, ranks: list[int]) -> pl.DataFrame:
    reference = min(ranks) if ranks else 0
    schema = {"rank": pl.Int64, "offset_ns": pl.Int64, "uncertainty_ns": pl.Int64, "matched": pl.Int64,
              "method": pl.String, "reference_rank": pl.Int64}
    if calls.is_empty():
        return pl.DataFrame(
            [{"rank": r, "offset_ns": 0 if r == reference else None, "uncertainty_ns": 0 if r == reference else None,
              "matched": 0, "method": "reference" if r == reference else "none (no collective kernels to match)",
              "reference_rank": reference} for r in ranks], schema=schema)
    ends = calls.select("rank", "instance", end=pl.col("ts_ns") + pl.col("dur_ns"))
    ref = ends.filter(pl.col("rank") == reference).select("instance", ref_end="end")
    diffs = ends.join(ref, on="instance").with_columns(diff=pl.col("end") - pl.col("ref_end"))
    estimates = diffs.group_by("rank").agg(
        offset_ns=pl.col("diff").median().round().cast(pl.Int64),
        uncertainty_ns=((pl.col("diff").max() - pl.col("diff").min()) / 2).round().cast(pl.Int64),
        matched=pl.len().cast(pl.Int64),
    )
    rows = pl.DataFrame({"rank": ranks}, schema={"rank": pl.Int64}).join(estimates, on="rank", how="left")
    return rows.with_columns(
        method=pl.when(pl.col("rank") == reference).then(pl.lit("reference"))
        .when(pl.col("offset_ns").is_not_null()).then(pl.lit("collective end times"))
        .otherwise(pl.lit("none (no collective shared with the reference rank)")),
        matched=pl.col("matched").fill_null(0),
        reference_rank=pl.lit(reference, pl.Int64),
    ).select(list(schema))


def collective_waits(calls: pl.DataFrame) -> pl.DataFrame:
    """Per call: how long this rank waited for the others (its time beyond the instance's fastest)."""
    return calls.with_columns(
        wait_ns=pl.col("dur_ns") - pl.col("dur_ns").min().over("instance"),
        ranks_in_instance=pl.col("rank").n_unique().over("instance"),
    )


def gpu_spans(work: pl.DataFrame) -> pl.DataFrame:
    """Per rank and step: first start and last end of the device work launched in the step."""
    return work.filter(pl.col("step").is_not_null()).group_by("rank", "step").agg(
        gpu_start_ns=pl.col("ts_ns").min(), gpu_end_ns=(pl.col("ts_ns") + pl.col("dur_ns")).max())


def step_times(steps: pl.DataFrame, gpu: pl.DataFrame, waits: pl.DataFrame, offsets: pl.DataFrame) -> pl.DataFrame:
    """Per rank and step: CPU window, its GPU projection (`gpu`, from gpu_spans), time spent waiting
    in collectives, and the window on the reference clock."""
    cpu = steps.group_by("rank", "step").agg(
        cpu_start_ns=pl.col("start_ns").min(), cpu_end_ns=pl.col("end_ns").max())
    if gpu.is_empty():
        gpu = pl.DataFrame(schema={"rank": pl.Int64, "step": pl.Int64, "gpu_start_ns": pl.Int64, "gpu_end_ns": pl.Int64})
    wait = waits.filter(pl.col("ranks_in_instance") > 1).group_by("rank", "step").agg(comm_wait_ns=pl.col("wait_ns").sum())
    table = (
        cpu.join(gpu, on=["rank", "step"], how="left")
        .join(wait, on=["rank", "step"], how="left")
        .join(offsets.select("rank", "offset_ns"), on="rank", how="left")
        .with_columns(
            cpu_dur_ns=pl.col("cpu_end_ns") - pl.col("cpu_start_ns"),
            gpu_dur_ns=pl.col("gpu_end_ns") - pl.col("gpu_start_ns"),
            comm_wait_ns=pl.col("comm_wait_ns").fill_null(0),
            aligned_start_ns=pl.col("cpu_start_ns") - pl.col("offset_ns"),
            aligned_end_ns=pl.col("cpu_end_ns") - pl.col("offset_ns"),
        )
        .drop("offset_ns")
        .sort("step", "rank")
    )
    return table


def refused_alignment(offsets: pl.DataFrame) -> dict:
    """findings.json's `clock_alignment`, when some rank's trace could not be aligned as the same job's."""
    refused = offsets.filter(pl.col("method").str.starts_with(REFUSED_PREFIX))
    if refused.is_empty():
        return {}
    return {"clock_alignment": {
        "reference_rank": int(offsets["reference_rank"][0]),
        "refused": [{"rank": rank, "reason": method[len(REFUSED_PREFIX):]}
                    for rank, method in refused.select("rank", "method").sort("rank").iter_rows()]}}  # rowwise-ok: per refused rank


def step_stats(times: pl.DataFrame, judge_stragglers: bool = True) -> pl.DataFrame:
    """Per step across ranks: durations, the slowest rank, the straggler and how long others waited.
    Without `judge_stragglers` (ranks of different jobs: nobody waited for anybody) no straggler is named."""
    has_comm = not times.is_empty() and times["comm_wait_ns"].sum() > 0
    # The last to arrive waits least; without collectives, fall back to the longest CPU step.
    last_rank = (
        pl.col("rank").sort_by(["comm_wait_ns", "cpu_dur_ns"], descending=[False, True]).first()
        if has_comm else pl.col("rank").sort_by("cpu_dur_ns").last()
    )
    stats = times.group_by("step").agg(
        ranks=pl.len(),
        min_dur_ns=pl.col("cpu_dur_ns").min(),
        median_dur_ns=pl.col("cpu_dur_ns").median().round().cast(pl.Int64),
        max_dur_ns=pl.col("cpu_dur_ns").max(),
        slowest_rank=pl.col("rank").sort_by("cpu_dur_ns").last(),
        candidate=last_rank,
        # on one clock only when every rank of the step is aligned: a rank without an offset (no collective to
        # match) left out would make it shorter than that rank's own step
        aligned_dur_ns=pl.when(pl.col("aligned_start_ns").null_count() + pl.col("aligned_end_ns").null_count() == 0)
        .then(pl.col("aligned_end_ns").max() - pl.col("aligned_start_ns").min()),
    )
    others = (
        times.join(stats.select("step", "candidate"), on="step")
        .filter(pl.col("rank") != pl.col("candidate"))
        .group_by("step")
        .agg(others_waited_ns=pl.col("comm_wait_ns").sum(),
             median_other_wait_ns=pl.col("comm_wait_ns").median().round().cast(pl.Int64))
    )
    stats = stats.join(others, on="step", how="left").with_columns(spread_ns=pl.col("max_dur_ns") - pl.col("min_dur_ns"))
    if not has_comm:  # nothing timed the waits: unknown, not 0
        stats = stats.with_columns(others_waited_ns=pl.lit(None, pl.Int64), median_other_wait_ns=pl.lit(None, pl.Int64))
    lateness = pl.col("median_other_wait_ns") if has_comm else pl.col("spread_ns")
    stats = stats.join(_rank_spread(times, has_comm), on="step", how="left").with_columns(lateness_ns=lateness)
    basis = _straggler_basis(stats.filter(pl.col("ranks") > 1).sort("step"))
    if not judge_stragglers or not has_comm:  # see the module's docstring: no waits, no straggler
        basis = basis.with_columns(straggler_basis=pl.lit(None, pl.String))
    stats = stats.join(basis, on="step", how="left")
    return stats.with_columns(straggler_rank=pl.when(pl.col("straggler_basis").is_not_null()).then(pl.col("candidate"))).select(
        "step", "ranks", "min_dur_ns", "median_dur_ns", "max_dur_ns", "spread_ns", "slowest_rank",
        "straggler_rank", "others_waited_ns", "median_other_wait_ns", "aligned_dur_ns", "straggler_basis",
    ).sort("step")


def _rank_spread(times: pl.DataFrame, has_comm: bool) -> pl.DataFrame:
    """Per step: the candidate's lead over the next-latest rank, and the spread (MAD / 0.6745) of the others."""
    lateness = -pl.col("comm_wait_ns") if has_comm else pl.col("cpu_dur_ns")  # higher = arrived later
    ranked = times.with_columns(late=lateness.cast(pl.Float64)).sort("step", "late", descending=[False, True])
    return ranked.group_by("step", maintain_order=True).agg(
        lead_ns=pl.col("late").first() - pl.col("late").get(1, null_on_oob=True),
        others_spread_ns=(pl.col("late").slice(1) - pl.col("late").slice(1).median()).abs().median() / MAD_Z_SCALE)


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (scipy.stats, which has it, takes a second
    to import: a third of a small run's whole analysis)."""
    if k <= 0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    log_n = math.lgamma(n + 1)
    return min(1.0, math.fsum(math.exp(log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
                              for i in range(k, n + 1)))


def _straggler_basis(stats: pl.DataFrame) -> pl.DataFrame:
    """step -> how the step's candidate was shown to stand out from the run's noise (absent: it was not)."""
    steps = stats.height
    material = pl.col("lateness_ns") >= STRAGGLER_MIN_SHARE * pl.col("median_dur_ns")
    reasons = []
    if steps:
        counts = stats.group_by("candidate").len().sort("len", "candidate", descending=[True, False]).row(0)
        ranks = int(stats["ranks"].max())
        p_value = binomial_tail(counts[1], steps, 1 / ranks)
        if p_value < ALPHA:
            reasons.append(pl.when(pl.col("candidate") == counts[0]).then(pl.lit(
                f"same_rank_last: rank {counts[0]} was last in {counts[1]} of {steps} steps; with {ranks} ranks taking "
                f"turns by chance, one-sided binomial p = {p_value:.2g} < {ALPHA}")))
    reasons.append(pl.when((pl.col("ranks") >= 3) & (pl.col("lead_ns") > OUTLIER_Z * pl.col("others_spread_ns"))).then(
        pl.format("beyond_rank_spread: {} ms ahead of the next-latest rank, over {} x the other ranks' spread ({} ms)",
                  (pl.col("lead_ns") / 1e6).round(3), pl.lit(OUTLIER_Z), (pl.col("others_spread_ns") / 1e6).round(3))))
    if steps >= MIN_NOISE_STEPS:
        # The largest wait among the other steps: the second largest overall for the step holding the largest.
        waits = stats["lateness_ns"].fill_null(0).sort(descending=True)
        other_max = pl.when(pl.col("lateness_ns") >= waits[0]).then(pl.lit(waits[1])).otherwise(pl.lit(waits[0]))
        reasons.append(pl.when(pl.col("lateness_ns") > OUTLIER_Z * other_max).then(
            pl.format("beyond_step_noise: the others waited {} ms, over {} x the most they waited in any other of "
                      "{} steps ({} ms)", (pl.col("lateness_ns") / 1e6).round(3), pl.lit(OUTLIER_Z), pl.lit(steps - 1),
                      (other_max / 1e6).round(3))))
    decided = pl.when(material).then(pl.coalesce(reasons))
    return stats.select("step", straggler_basis=decided.cast(pl.String))


def straggler_finding(stats: pl.DataFrame) -> dict:
    """The steps with a straggler that stands out from the run's noise, and how each was decided."""
    if stats.is_empty():
        return {}
    stragglers = stats.filter(pl.col("straggler_rank").is_not_null())
    return {"stragglers": [
        {"step": s, "rank": r, "others_waited_ns": w, "spread_ns": d, "basis": "collective_wait", "decided_by": how}
        for s, r, w, d, how in
        stragglers.select("step", "straggler_rank", "others_waited_ns", "spread_ns", "straggler_basis").iter_rows()]}


# ---------------------------------------------------------------------------------------------
# What it says


def alignment_lines(finding: dict) -> list[str]:
    """Traces that cannot be ranks of one job (unalignable)."""
    alignment = finding.get("clock_alignment") or {}
    return [f"Not one job: rank {r['rank']}'s trace is not aligned with rank {alignment['reference_rank']}'s ({r['reason']}); "
            "its steps are not drawn on one clock with the others and no straggler is named across them."
            for r in alignment.get("refused", [])]


def straggler_lines(finding: dict, limit: int = 2) -> list[str]:
    """Stragglers that stand out from the run's noise, each with the test that decided it."""
    lines = []
    for s in finding.get("stragglers", [])[:limit]:
        how = f" Decided by {s['decided_by']}." if s.get("decided_by") else ""
        lines.append(f"Straggler: rank {s['rank']} in step {s['step']}; the other ranks waited "
                     f"{duration(s['others_waited_ns'])} in total for it in collectives.{how}")
    return lines


def steps_phrase(finding: dict, findings: dict) -> list[str]:
    return alignment_lines(finding) + straggler_lines(finding, limit=3)


# ---------------------------------------------------------------------------------------------
# The analysis


def _steps(inputs: Inputs) -> Output:
    if not inputs.ranks:
        return Output()
    calls = inputs.table("_collective_calls")
    profiled = inputs.table("steps", ["rank", "step", "start_ns", "end_ns"])
    context = inputs.context
    offsets = clock_offsets(calls, inputs.ranks, context.world_size_of_rank if context else {}, profiled,
                            context.file_of_rank if context else {})
    times = step_times(profiled, inputs.table("_gpu_spans"), collective_waits(calls), offsets)
    refused = refused_alignment(offsets)
    stats = step_stats(times, judge_stragglers=not refused)
    return Output(tables={"clock_offsets": offsets, "step_times": times, "step_stats": stats},
                  finding={**straggler_finding(stats), **refused} or None)


CLOCK_OFFSETS = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("offset_ns", pa.int64(), "This rank's clock minus the reference rank's (aligned time = ts_ns - offset_ns)."),
    ("uncertainty_ns", pa.int64(), "Half the range of the per-collective estimates."),
    ("matched", pa.int64(), "Collective instances shared with the reference rank."),
    ("method", pa.string(), "How it was estimated (collective end times, reference, one clock with the ranks of its "
                            "file, or none), or 'refused: ' and why "
                            "the trace cannot be aligned as a rank of the same job."),
    ("reference_rank", pa.int64(), "The rank whose clock is the reference (the lowest)."),
)

STEP_TIMES = schema.table_spec(
    ("rank", pa.int64(), "Rank."),
    ("step", pa.int64(), "ProfilerStep number."),
    ("cpu_start_ns", pa.int64(), "Start of the step annotation (rank clock)."),
    ("cpu_end_ns", pa.int64(), "Its end."),
    ("cpu_dur_ns", pa.int64(), "CPU step duration."),
    ("gpu_start_ns", pa.int64(), "First start of device work launched in the step."),
    ("gpu_end_ns", pa.int64(), "Last end of it."),
    ("gpu_dur_ns", pa.int64(), "GPU projection of the step."),
    ("comm_wait_ns", pa.int64(), "Time this rank waited in collectives for slower ranks in the step."),
    ("aligned_start_ns", pa.int64(), "cpu_start_ns on the reference clock."),
    ("aligned_end_ns", pa.int64(), "cpu_end_ns on the reference clock."),
)

STEP_STATS = schema.table_spec(
    ("step", pa.int64(), "ProfilerStep number."),
    ("ranks", pa.int64(), "Ranks that recorded it."),
    ("min_dur_ns", pa.int64(), "Shortest CPU step over ranks."),
    ("median_dur_ns", pa.int64(), "Median."),
    ("max_dur_ns", pa.int64(), "Longest."),
    ("spread_ns", pa.int64(), "max_dur_ns - min_dur_ns."),
    ("slowest_rank", pa.int64(), "Rank with the longest CPU step."),
    ("straggler_rank", pa.int64(), "Rank the others waited for (last to arrive at collectives; without collective "
                                   "timing the longest step), when it stands out from the run's noise "
                                   "(straggler_basis) and the wait is >= 5% of the step."),
    ("others_waited_ns", pa.int64(), "Total collective wait of the other ranks in the step; null when no communication "
                                     "kernel timed the waits (gloo/CPU runs)."),
    ("median_other_wait_ns", pa.int64(), "Median of it over the other ranks."),
    ("aligned_dur_ns", pa.int64(), "Step wall time across ranks on the aligned clock (first start to last end); null "
                                   "when a rank of the step has no clock offset."),
    ("straggler_basis", pa.string(), "How the straggler was shown to stand out from the run's noise (same_rank_last, "
                                     "beyond_rank_spread), with its numbers; null: no straggler."),
)


ANALYSIS = Analysis("steps", "Steps and stragglers", ("_collective_calls", "_gpu_spans", "steps"),
                    {"clock_offsets": CLOCK_OFFSETS, "step_times": STEP_TIMES, "step_stats": STEP_STATS}, _steps,
                    former_keys={"stragglers": "stragglers", "clock_alignment": "clock_alignment"}, phrase=steps_phrase)
