"""Logs-only hang attribution (issue 12): each rank's last log line (time and text) in the job_end finding, on
the real killed 2-rank DeepSpeed job (tests/conftest.py ds_killed_run) and on hand-built facts."""

from __future__ import annotations

import re
import shutil
from datetime import datetime, timezone

import polars as pl
from conftest import REALRUN_KILLED
from test_job_end import analyse
from steplens.analyze.analyses import job_end

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")


def stamp_ns(line: str) -> int | None:
    """The DeepSpeed logger's stamp, read as UTC (as the importer reads it), with the standard library only."""
    if not (m := STAMP.match(line)):
        return None
    seconds = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return int(seconds) * 10**9 + int(m[2]) * 10**6


def test_each_ranks_last_log_line_is_in_the_job_end_finding(ds_killed_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ds_killed_run / "rank_logs", run / "rank_logs")
    shutil.copyfile(ds_killed_run / "launcher.log", run / "launcher.log")
    findings, lines, _ = analyse(run, tmp_path / "out")
    end = findings["job_end"]
    assert end["status"] == "killed"
    got = {row["rank"]: row for row in end["last_log_lines"]}
    assert sorted(got) == [0, 1]
    for rank in (0, 1):
        (log,) = (run / "rank_logs").glob(f"*rank{rank}.log")
        text = log.read_text().splitlines()
        number = max(i for i, line in enumerate(text, 1) if line.strip())
        stamped = [line for line in text[:number] if stamp_ns(line) is not None]
        row = got[rank]
        # (a long line is cut at 300 characters: here rank 0's gloo error)
        assert (row["source"], row["line"], row["text"]) == (f"rank_logs/{log.name}", number, text[number - 1].strip()[:300])
        assert row["wall_ns"] == stamp_ns(text[number - 1])
        assert row["not_before_ns"] == (stamp_ns(stamped[-1]) if stamped else None)
    # The killed rank's log ends before the surviving rank's: its last stamped line is the earlier one.
    killed = REALRUN_KILLED["rank"]
    assert got[killed]["not_before_ns"] <= got[1 - killed]["not_before_ns"]
    words = job_end.last_log_line_lines(findings["job_end"])
    assert len(words) == 2 and all(w.startswith("Rank ") and "'s last log line (rank_logs/" in w for w in words)
    assert any(f"rank_logs/{got[killed]['source'].split('/')[-1]}:{got[killed]['line']}, " in w
               and w.endswith(got[killed]["text"]) for w in words)


def test_the_rank_silent_first_is_named_only_when_every_last_line_has_a_time():
    status = pl.DataFrame({"status": ["incomplete"], "error": [None]}, schema={"status": pl.String, "error": pl.String})
    empty = pl.DataFrame()
    base = 1_700_000_000 * 10**9
    facts = {"log_last_line_rank0": {"line": 90, "text": "[2023-11-14 22:13:30,000] ... step=40", "wall_ns": base + 30 * 10**9,
                                     "not_before_ns": base + 30 * 10**9, "source": "r0.log"},
             "log_last_line_rank1": {"line": 70, "text": "[2023-11-14 22:13:20,000] ... step=30", "wall_ns": base + 20 * 10**9,
                                     "not_before_ns": base + 20 * 10**9, "source": "r1.log"}}
    found = job_end.job_end(status, empty, empty, empty, facts, median_step_ns=1e9)
    assert found["first_stalled_rank"] == 1 and "10,000 ms before the next rank's" in found["basis"]
    assert [row["rank"] for row in found["last_log_lines"]] == [1, 0]
    # Rank 1's last line was print()ed (no time of its own): it may be later than rank 0's; nobody is named.
    facts["log_last_line_rank1"] = {**facts["log_last_line_rank1"], "wall_ns": None}
    found = job_end.job_end(status, empty, empty, empty, facts, median_step_ns=1e9)
    assert found["first_stalled_rank"] is None and [row["rank"] for row in found["last_log_lines"]] == [0, 1]
