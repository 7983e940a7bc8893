"""How the job ended, and which rank stopped making progress first.

Progress per rank is the last optimizer step it is seen to finish (the collector's `train_steps`,
the log's timer lines and step/throughput/iteration lines) and the time of its last record, with the
state of its collector manifest. The rank that stopped first is, in this order of evidence:

1. a rank whose collector manifest never closed (still ``running``) while another rank's did
   (``completed`` or ``failed``): its process died without running its exit hooks (SIGKILL, the
   OOM killer) or hangs; among several, the one updated last the earliest;
2. the one rank with the fewest finished steps;
3. among ranks tied on steps, the one whose last record is earliest by more than one median step;
4. the rank whose last log line (run fact ``log_last_line_rank<r>`` from the DeepSpeed log importer) is
   earliest by more than one median step: a logs-only run whose lines name no steps.

Otherwise no rank is named: every rank got as far as the others. The cause is read from the status
errors: an NCCL watchdog timeout, or a lost peer (a connection reset, a remote worker hanging).
The finding lists each rank's last log line (time, file, line number, text), earliest first, so a reader
sees where each rank fell silent.
"""

from __future__ import annotations

import re

import polars as pl

from steplens.analyze.analyses.registry import Analysis, Inputs, Output
from steplens.analyze.analyses.step_time import superseded
from steplens.analyze.contract import layout
from datetime import datetime, timezone

WATCHDOG = re.compile(r"watchdog caught collective operation timeout|collective operation timeout|"
                      r"ProcessGroupNCCL.{0,80}time(d)? ?out|NCCL.{0,40}timeout", re.IGNORECASE)
PEER_LOST = re.compile(r"connection (reset|closed) by peer|remote worker hanging|communicator was aborted|"
                       r"broken pipe", re.IGNORECASE)
ENDED_BADLY = ("failed", "killed", "incomplete")


def progress(train_steps: pl.DataFrame, step_timers: pl.DataFrame, scalars: pl.DataFrame, facts: dict) -> pl.DataFrame:
    """Per rank: last finished step, time of the last record (ns, rank clock) and collector manifest status."""
    parts = []
    if not train_steps.is_empty():  # the timeline the job went on with (a job run again for fewer steps ended earlier)
        parts.append(train_steps.filter(~superseded(train_steps) & pl.col("is_boundary").fill_null(False))
                     .select("rank", "step", record_ns="end_ns"))
    if not step_timers.is_empty():
        parts.append(step_timers.select("rank", "step", record_ns=pl.lit(None, pl.Int64)))
    if not scalars.is_empty():
        parts.append(scalars.filter(pl.col("origin") == "log").select("rank", "step", record_ns="wall_ns"))
    manifests = [{"rank": int(key.removeprefix("collector_rank")), "manifest_status": value.get("status"),
                  "manifest_updated_ns": value.get("updated_ns")}
                 for key, value in facts.items() if key.startswith("collector_rank") and isinstance(value, dict)]
    schema = {"rank": pl.Int64, "manifest_status": pl.String, "manifest_updated_ns": pl.Int64}
    seen = (pl.concat([p.cast({"rank": pl.Int64, "step": pl.Int64, "record_ns": pl.Int64}) for p in parts])
            .filter(pl.col("rank").is_not_null())
            .group_by("rank").agg(last_step=pl.col("step").max(), last_record_ns=pl.col("record_ns").max())
            if parts else pl.DataFrame(schema={"rank": pl.Int64, "last_step": pl.Int64, "last_record_ns": pl.Int64}))
    return seen.join(pl.DataFrame(manifests, schema=schema), on="rank", how="full", coalesce=True).sort("rank")


def _first_stalled(ranks: pl.DataFrame, median_step_ns: float | None,
                   flush_every: int | None = None) -> tuple[int | None, str]:
    status = ranks["manifest_status"]
    if status.is_in(["running"]).any() and status.is_in(["completed", "failed"]).any():
        open_ranks = ranks.filter(pl.col("manifest_status") == "running").sort("manifest_updated_ns", nulls_last=True)
        rank = open_ranks["rank"][0]
        return rank, (f"its collector manifest never closed (the process died without its exit hooks: SIGKILL, the OOM "
                      f"killer, or it hangs) while rank(s) {_ranks(ranks.filter(pl.col('manifest_status') != 'running'))} "
                      "closed theirs")
    stepped = ranks.filter(pl.col("last_step").is_not_null())
    if stepped["last_step"].n_unique() > 1:
        fewest = stepped.filter(pl.col("last_step") == pl.col("last_step").min())
        if fewest.height == 1:
            spread = stepped["last_step"].max() - stepped["last_step"].min()
            if stepped["manifest_status"].eq_missing("running").all() and type(flush_every) is int \
                    and spread < flush_every:  # the whole job killed: each record ends at its rank's last flush
                return None, (f"every rank's collector manifest stayed open (the whole job was killed); their last "
                              f"recorded steps ({stepped['last_step'].min()}-{stepped['last_step'].max()}) differ by "
                              f"less than a flush ({flush_every} steps), which tells no rank apart")
            if fewest["manifest_status"][0] == "running":  # died without its exit hooks: its last rows unflushed
                return fewest["rank"][0], (
                    f"its last recorded step is {fewest['last_step'][0]}, the others reached step "
                    f"{stepped['last_step'].max()} (its collector manifest never closed: the steps after its last "
                    "flush were lost with the process, so it may have got further)")
            return fewest["rank"][0], (f"its last finished step is {fewest['last_step'][0]}, the others reached "
                                       f"step {stepped['last_step'].max()}")
    else:
        fewest = stepped
    timed = fewest.filter(pl.col("last_record_ns").is_not_null()).sort("last_record_ns")
    if timed.height >= 2 and median_step_ns and timed["last_record_ns"][1] - timed["last_record_ns"][0] > median_step_ns:
        gap = (timed["last_record_ns"][1] - timed["last_record_ns"][0]) / 1e6
        return timed["rank"][0], (f"all reached step {timed['last_step'][0]}, but its last record is {gap:,.0f} ms "
                                  f"before the next rank's (more than one median step)")
    return None, "every rank got as far as the others: nothing tells which stopped first"


def last_log_lines(facts: dict) -> list[dict]:
    """Each rank's last log line: rank, wall_ns (its own time stamp; None for a print()ed line), not_before_ns
    (the latest stamp of the rank's lines up to it), source, line, text; earliest first, lines without a time
    last."""
    rows = []
    for key, value in facts.items():
        rank = key.removeprefix("log_last_line_rank")
        if key != rank and rank.isdigit() and isinstance(value, dict):
            rows.append({"rank": int(rank), **{k: value.get(k) for k in ("wall_ns", "not_before_ns", "source", "line",
                                                                          "text")}})
    return sorted(rows, key=lambda r: (r["wall_ns"] is None, r["wall_ns"] or 0, r["rank"]))


def _silent_first(lines: list[dict], median_step_ns: float | None) -> tuple[int | None, str]:
    """Only when every rank's last line carries its own time: a print()ed last line could be later than any stamp."""
    timed = [line for line in lines if line["wall_ns"] is not None]
    if len(timed) == len(lines) and len(timed) >= 2 and median_step_ns and timed[1]["wall_ns"] - timed[0]["wall_ns"] > median_step_ns:
        gap = (timed[1]["wall_ns"] - timed[0]["wall_ns"]) / 1e6
        return timed[0]["rank"], (f"its last log line is {gap:,.0f} ms before the next rank's (more than one median "
                                  "step)")
    return None, ""


def _ranks(frame: pl.DataFrame) -> str:
    return ", ".join(str(r) for r in frame["rank"].to_list())


def job_end(run_status: pl.DataFrame, train_steps: pl.DataFrame, step_timers: pl.DataFrame, scalars: pl.DataFrame,
            facts: dict, median_step_ns: float | None) -> dict | None:
    """The `job_end` finding, or None for a job that completed with every rank in step."""
    ranks = progress(train_steps, step_timers, scalars, facts)
    bad = run_status.filter(pl.col("status").is_in(ENDED_BADLY)) if not run_status.is_empty() else run_status
    # A collector manifest left 'running' says the collector's record stops there (its writes failed: a read-only
    # or full disk), not that the job did, when the launcher saw every process exit 0; nor do records that end at
    # different steps then say a rank stalled.
    launcher_completed = {"rank", "status"} <= set(run_status.columns) and not run_status.filter(
        pl.col("rank").is_null() & (pl.col("status") == "completed")).is_empty()
    if launcher_completed and not bad.is_empty():
        manifest = pl.col("source").str.contains(f"(^|/){layout.COLLECTOR_DIR}/{layout.MANIFEST_DIR}/", literal=False)
        bad = bad.filter(~((pl.col("status") == "incomplete") & manifest.fill_null(False))) \
            if "source" in bad.columns else bad
    # Likewise a launcher's log that stops before the job's end (the launcher killed, its log cut) says nothing of the
    # ranks when every rank's collector manifest recorded its completion.
    world = facts.get("world_size")
    ranks_completed = (not ranks.is_empty() and ranks["manifest_status"].eq_missing("completed").all()
                       and (not isinstance(world, int) or ranks.height == world))
    if ranks_completed and not bad.is_empty():
        bad = bad.filter(~(pl.col("rank").is_null() & (pl.col("status") == "incomplete")))
    uneven = ranks.height > 1 and (ranks["last_step"].n_unique() > 1 or ranks["manifest_status"].n_unique() > 1) \
        and not (launcher_completed and bad.is_empty())
    if bad.is_empty() and not uneven:
        return None
    errors = [e for e in (bad["error"].drop_nulls().to_list() if not bad.is_empty() else []) if e]
    # the error that ended the job before those it set off: a lost peer or a watchdog timeout on the other ranks
    errors.sort(key=lambda e: bool(WATCHDOG.search(e) or PEER_LOST.search(e)))
    cause = ("nccl_watchdog_timeout" if any(WATCHDOG.search(e) for e in errors)
             else "peer_lost" if any(PEER_LOST.search(e) for e in errors) else None)
    flush_every = (facts.get("settings") or {}).get("flush_every")  # the collector's
    rank, basis = _first_stalled(ranks, median_step_ns, flush_every) if ranks.height > 1 else (None, "one rank")
    lines = last_log_lines(facts)
    if rank is None and (silent := _silent_first(lines, median_step_ns))[0] is not None:
        rank, basis = silent
    order = {"killed": 0, "failed": 1, "incomplete": 2}
    worst = min(bad["status"].to_list(), key=order.get) if not bad.is_empty() else None
    return {"status": worst, "errors": errors[:3], "cause": cause, "first_stalled_rank": rank, "basis": basis,
            "progress": ranks.to_dicts(), "last_log_lines": lines}


# ---------------------------------------------------------------------------------------------
# What it says


CAUSE_WORDS = {"nccl_watchdog_timeout": "an NCCL watchdog timeout: a collective waited past its timeout for a rank that "
                                         "never joined it",
               "peer_lost": "a lost peer: the other ranks' collectives failed when a rank died or stopped answering"}


def job_end_lines(end: dict, with_status: bool = False) -> list[str]:
    """How the job ended (with_status: also its status, for the terminal, which has no run_status table)
    and the rank that stopped making progress first."""
    lines = []
    if with_status and end.get("status"):
        what = {"failed": "failed", "killed": "was killed", "incomplete": "did not finish"}[end["status"]]
        lines.append(f"The job {what}" + (f": {end['errors'][0].rstrip('.')}" if end.get("errors") else "") + ".")
    if end.get("cause"):
        lines.append(f"It ended on {CAUSE_WORDS[end['cause']]}.")
    if end.get("first_stalled_rank") is not None:
        lines.append(f"Rank {end['first_stalled_rank']} stopped making progress first: {end['basis']}.")
    return lines


def _log_clock(ns: int) -> str:
    """A log line's time as the log printed it (importers read the zone-less stamps as UTC)."""
    return datetime.fromtimestamp(ns / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def last_log_line_lines(end: dict, limit: int = 4) -> list[str]:
    """For a job that did not end cleanly: each rank's last log line (where, when, what), earliest first, so a
    reader sees which rank fell silent first (job_end.last_log_lines)."""
    lines = []
    for row in (end.get("last_log_lines") or [])[:limit]:
        if row.get("wall_ns") is not None:
            when = f"at {_log_clock(row['wall_ns'])}"
        elif row.get("not_before_ns") is not None:
            when = f"no time of its own, after {_log_clock(row['not_before_ns'])}"
        else:
            when = "no time"
        lines.append(f"Rank {row['rank']}'s last log line ({row['source']}:{row['line']}, {when}): {row['text']}")
    return lines


def job_end_phrase(end: dict, findings: dict) -> list[str]:
    return job_end_lines(end, with_status=True) + last_log_line_lines(end)


# ---------------------------------------------------------------------------------------------
# Its report section


def status_section(page, run):
    """How the job ended, per launcher or log file (the run_status table the importers read)."""
    status = run.table("run_status")
    if status.is_empty():
        return None
    section = page.section("How the job ended", "status")
    section.rows(status, {
        "source": ("file", "text"), "run_index": ("run in the file", "text"), "rank": ("rank", "text"),
        "status": ("status", "text"), "exit_code": ("exit code", "text"), "error": ("error", "text")}, "run_status")
    return section


# ---------------------------------------------------------------------------------------------
# The analysis


def _job_end(inputs: Inputs) -> Output:
    ended = job_end(inputs.table("run_status"), inputs.table("train_steps"), inputs.table("step_timers"),
                    inputs.table("scalars"), inputs.facts, inputs.findings["step_time"].get("median_ns"))
    return Output(finding=ended or None)


ANALYSIS = Analysis("job_end", "How the job ended", ("run_status", "train_steps", "step_timers", "scalars", "step_time"), {},
                    _job_end, phrase=job_end_phrase, section=status_section)
