"""How a job ended and which rank stopped first, on a real 2-rank DeepSpeed job that loses a rank.

The ground truth is the job's own arguments (which rank SIGKILLs itself, after which step); the
progress per rank is recomputed from the collector's raw Parquet parts and manifests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from conftest import REALRUN_KILLED
from steplens.reports import data, verdict


def analyse(run_dir: Path, out: Path) -> tuple[dict, list[str], str]:
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"})
    assert done.returncode in (0, 1), done.stderr[-3000:]
    run = data.load(out)
    return run.findings, verdict.verdict(run), done.stdout


def test_the_killed_rank_is_named(ds_killed_run, tmp_path):
    findings, lines, stdout = analyse(ds_killed_run, tmp_path / "out")
    killed = REALRUN_KILLED["rank"]
    end = findings["job_end"]
    assert end["status"] == "killed" and end["first_stalled_rank"] == killed
    manifests = {r: json.loads((ds_killed_run / "collector" / "manifest" / f"rank{r}.json").read_text()) for r in (0, 1)}
    # The killed rank's manifest never closed. The other one closed either way the race goes: "failed" when its
    # collective with the dead rank raised first, "terminated" when the launcher's SIGTERM came first (seen in CI).
    assert manifests[killed]["status"] == "running" and manifests[1 - killed]["status"] in ("failed", "terminated")
    last_steps: dict[int, int] = {}
    for part in (ds_killed_run / "collector" / "train_steps").glob("*.parquet"):
        for row in pq.read_table(part).to_pylist():
            if row["is_boundary"]:
                last_steps[row["rank"]] = max(last_steps.get(row["rank"], -1), row["step"])
    progress = {p["rank"]: p for p in end["progress"]}
    for rank, step in last_steps.items():
        assert progress[rank]["last_step"] >= step  # logs may show a later step than the flushed parts
        assert progress[rank]["manifest_status"] == manifests[rank]["status"]
    assert last_steps[killed] <= REALRUN_KILLED["after_step"]
    sentence = f"Rank {killed} stopped making progress first: its collector manifest never closed"
    assert any(line.startswith(sentence) for line in lines)
    assert f"Rank {killed} stopped making progress first" in stdout and "The job was killed" in stdout


def test_logs_only_killed_job(ds_killed_run, tmp_path):
    """Only the launcher's log and the per-rank logs: the job's end is known, the first rank to stop is
    not (rank 1 prints no step lines), and nothing is guessed."""
    run = tmp_path / "run"
    shutil.copytree(ds_killed_run / "rank_logs", run / "rank_logs")
    shutil.copyfile(ds_killed_run / "launcher.log", run / "launcher.log")
    findings, lines, stdout = analyse(run, tmp_path / "out")
    end = findings["job_end"]
    assert end["status"] == "killed" and end["first_stalled_rank"] is None
    assert "The job was killed" in stdout
    assert not any("stopped making progress first" in line for line in lines)


def test_nccl_watchdog_timeout_is_named_as_the_cause():
    """run_status as the log importer leaves it for a job the launcher ended after a timeout; the error
    line is PyTorch's own (ProcessGroupNCCL.cpp)."""
    import polars as pl
    from steplens.analyze.analyses import job_end

    error = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=BROADCAST, "
             "NumelIn=131072000, NumelOut=131072000, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.")
    status = pl.DataFrame({"rank": [None], "source": ["launcher.log"], "run_index": [0], "status": ["failed"],
                           "exit_code": [1], "error": [error], "detail": ["a rank exited with return code 1"]})
    end = job_end.job_end(status, pl.DataFrame(), pl.DataFrame(), pl.DataFrame(), {}, None)
    assert (end["status"], end["cause"], end["first_stalled_rank"]) == ("failed", "nccl_watchdog_timeout", None)
    assert job_end.job_end_lines(end, with_status=True) == [
        f"The job failed: {error}",  # one full stop, the error's own
        "It ended on an NCCL watchdog timeout: a collective waited past its timeout for a rank that never joined it."]


def test_a_collector_record_that_stops_early_is_not_the_jobs_end():
    """The collector's folder went read-only mid-run: its manifests stayed 'running' at step 10 while the launcher
    saw every process exit 0, and the verdict said 'The job did not finish'. A manifest left running does not
    outweigh the launcher's completed; it still does when the launcher says nothing, or the job failed."""
    import polars as pl
    from steplens.analyze.analyses import job_end

    def row(rank, source, status):
        return {"rank": rank, "source": source, "run_index": 0, "status": status, "exit_code": None, "error": None,
                "detail": ""}

    manifests = [row(r, f"collector/manifest/rank{r}.json", "incomplete") for r in (0, 1)]
    completed = pl.DataFrame([row(None, "launcher.log", "completed"), *manifests])
    assert job_end.job_end(completed, pl.DataFrame(), pl.DataFrame(), pl.DataFrame(), {}, None) is None
    alone = pl.DataFrame(manifests)
    assert job_end.job_end(alone, pl.DataFrame(), pl.DataFrame(), pl.DataFrame(), {}, None)["status"] == "incomplete"
    failed = pl.DataFrame([row(None, "launcher.log", "completed"), row(1, "rank_logs/x_rank1.log", "failed"), *manifests])
    assert job_end.job_end(failed, pl.DataFrame(), pl.DataFrame(), pl.DataFrame(), {}, None)["status"] == "failed"



def test_a_launcher_log_cut_short_is_not_the_jobs_end_when_every_rank_recorded_its_completion():
    """The helper's job whose launcher process was SIGKILLed while its ranks ran on to step 60 and closed their
    collector manifests: the launcher's log has no end, and the verdict said 'The job did not finish'. Every rank's
    completed manifest outweighs it; a rank without one, or one still running, does not."""
    import polars as pl
    from steplens.analyze.analyses import job_end

    def row(rank, source, status):
        return {"rank": rank, "source": source, "run_index": 0, "status": status, "exit_code": None, "error": None,
                "detail": ""}

    def facts(*statuses):
        return {"world_size": 2, **{f"collector_rank{r}": {"status": s, "updated_ns": 10**18 + r}
                                    for r, s in enumerate(statuses)}}

    cut = [row(None, "launcher.log", "incomplete")]
    manifests = [row(r, f"collector/manifest/rank{r}.json", "completed") for r in (0, 1)]
    status = pl.DataFrame(cut + manifests)
    none = pl.DataFrame()
    assert job_end.job_end(status, none, none, none, facts("completed", "completed"), None) is None
    one_open = pl.DataFrame(cut + manifests[:1] + [row(1, "collector/manifest/rank1.json", "incomplete")])
    assert job_end.job_end(one_open, none, none, none, facts("completed", "running"), None)["status"] == "incomplete"
    one_missing = pl.DataFrame(cut + manifests[:1])
    assert job_end.job_end(one_missing, none, none, none, facts("completed"), None)["status"] == "incomplete"

def test_records_that_end_unevenly_are_no_stall_when_every_process_exited_0():
    """On a full disk the ranks' collector records stopped at different steps, and analyze said 'Rank 1 stopped
    making progress first' of a job whose every process exited 0. Hand-made records: rank 0 to step 11, rank 1 to 5."""
    import polars as pl
    from steplens.analyze.analyses import job_end
    from steplens.analyze.importers.base import conform

    rows = [{"rank": rank, "source": f"collector/train_steps/rank{rank}-00000.parquet", "step": step, "micro_step": step,
             "start_ns": step * 10**8, "end_ns": step * 10**8 + 5 * 10**7, "dur_ns": 5 * 10**7, "is_boundary": True}
            for rank, last in ((0, 11), (1, 5)) for step in range(last + 1)]
    train_steps = conform(rows, "train_steps")
    launcher = pl.DataFrame({"rank": [None], "source": ["launcher.log"], "run_index": [0], "status": ["completed"],
                             "exit_code": [0], "error": [None], "detail": ["2 process(es) exited successfully"]},
                            schema_overrides={"rank": pl.Int64, "error": pl.String})
    assert job_end.job_end(launcher, train_steps, pl.DataFrame(), pl.DataFrame(), {}, None) is None
    unknown = launcher.with_columns(status=pl.lit("unknown"))
    assert job_end.job_end(unknown, train_steps, pl.DataFrame(), pl.DataFrame(), {}, None)["first_stalled_rank"] == 1


LAUNCHED = ("[2026-12-07 01:18:44,451] [INFO] [launch.py:245:main] process 26634 spawned with command: ['python3', '-u', "
            "'job.py', '--local_rank={r}']\n")
EXITED = ("[2026-12-07 01:19:03,542] [ERROR] [launch.py:259:sigkill_handler] ['python3', '-u', 'job.py', "
          "'--local_rank=1'] exits with return code = 1\n")
PEER = ("[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:53144. This is typically caused by a remote worker crashing.\n")


def test_a_crash_names_its_error_from_the_rank_logs_and_the_rank_the_launcher_saw_fail(tmp_path):
    """A rank raised before DeepSpeed logged a line (its default level): its traceback, alone in DeepSpeed's
    --enable_each_rank_log file, was ignored as 'no format steplens knows' and the verdict said only 'The job
    failed'; the other rank's lost-peer error is what it set off. Hand-made from the helper's crashed job's lines."""
    run = tmp_path / "run"
    (run / "rank_logs").mkdir(parents=True)
    (run / "launcher.log").write_text(LAUNCHED.format(r=0) + LAUNCHED.format(r=1) + EXITED)
    (run / "rank_logs" / "20261207011844_rank1.log").write_text(
        "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"job.py\", line 81, in <module>\n"
        "[rank1]:     raise RuntimeError(\"user bug: bad batch at step 5\")\n"
        "[rank1]: RuntimeError: user bug: bad batch at step 5\n")
    (run / "rank_logs" / "20261207011844_rank0.log").write_text("[rank0]: Traceback (most recent call last):\n" + PEER)
    findings, _lines, stdout = analyse(run, tmp_path / "out")
    end = findings["job_end"]
    assert end["status"] == "failed" and end["cause"] == "peer_lost"
    assert end["errors"][0] == "RuntimeError: user bug: bad batch at step 5"
    assert "The job failed: RuntimeError: user bug: bad batch at step 5" in stdout
    status = [r for r in pq.read_table(tmp_path / "out" / "run_status").to_pylist() if r["source"] == "launcher.log"]
    assert status[0]["detail"].startswith("local rank 1 exited with return code 1")


def test_a_failed_rank_whose_steps_were_all_flushed_lost_no_data(tmp_path):
    """The collector's manifest says 'failed' after 5 steps with step 4 flushed last: every step the rank finished is
    in its parts. That was an error-level 'collector_missing_tail ... everything after is missing' and exit 1
    ('inputs could not be used'); it is the job's failure, not lost input. One unflushed step still is."""
    sample = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"
    for name, last in (("whole", 5), ("cut", 4)):
        run = tmp_path / name
        shutil.copytree(sample, run, ignore=shutil.ignore_patterns(".steplens"))
        manifest = run / "collector" / "manifest" / "rank1.json"
        doc = json.loads(manifest.read_text())
        steps = doc["steps_completed"]
        doc.update(status="failed", last_flushed_step=steps - 1 if name == "whole" else steps - 2)
        manifest.write_text(json.dumps(doc))
        done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run), "-q"], capture_output=True, text=True)
        issues = pq.read_table(run / ".steplens" / "ingest_issues").to_pylist()
        tail = [i for i in issues if i["reason"] == "collector_missing_tail"]
        assert (len(tail), done.returncode) == ((0, 0) if name == "whole" else (1, 1)), (name, done.stdout)
        assert json.loads((run / ".steplens" / "findings.json").read_text())["job_end"]["status"] == "failed"


def test_a_killed_rank_s_last_step_is_its_last_recorded_one():
    """A rank SIGKILLed after step 17 with the collector flushing every 5 steps had written its rows up to step 14:
    it was 'its last finished step is 14' (a real sweep's job: both ranks finished step 17). The step is the
    last the rank recorded, and may have been passed."""
    import polars as pl

    from steplens.analyze.analyses import job_end

    ranks = pl.DataFrame({"rank": [0, 1], "last_step": [17, 14], "last_record_ns": [2_000, 1_000],
                          "manifest_status": ["terminated", "running"], "manifest_updated_ns": [2_000, 1_000]})
    rank, basis = job_end._first_stalled(ranks, 10.0)
    assert rank == 1 and basis.startswith("its last recorded step is 14, the others reached step 17")
    assert "may have got further" in basis
    closed = ranks.with_columns(manifest_status=pl.lit("terminated"))
    assert job_end._first_stalled(closed, 10.0)[1] == "its last finished step is 14, the others reached step 17"
    # every rank killed at once (a scheduler's time limit), flushing every 5 steps: 3 steps behind is no stall;
    # a rank 5 or more behind stopped first
    killed = ranks.with_columns(manifest_status=pl.lit("running"))
    rank, basis = job_end._first_stalled(killed, 10.0, flush_every=5)
    assert rank is None and "tells no rank apart" in basis
    assert job_end._first_stalled(killed, 10.0, flush_every=3)[0] == 1


def test_a_collector_manifest_without_status_or_steps_says_so(tmp_path):
    """A manifest whose status and step count are gone (mangled): the issue read "says None ... None steps had run"."""
    from steplens.analyze.importers import collector_parts

    path = tmp_path / "collector" / "manifest" / "rank0.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": "steplens-collector-manifest", "rank": 0, "last_flushed_step": None}))
    (issue,) = [i for i in collector_parts.parse(path, "collector/manifest/rank0.json").issues
                if i[1] == "collector_missing_tail"]
    assert "gives no status" in issue[3] and "None" not in issue[3] and "nothing was flushed" in issue[3]
