"""The collector never breaks or starves the job (issue 13): attach never raises, a failed writer stops
buffering, a value that is not a number costs that point only, SIGTERM flushes and says so.

In-process tests use a plain torch model (the same Collector code as the DeepSpeed form); the real 2-rank
DeepSpeed jobs are in tests/test_collect_safety_realrun.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze.pipeline import ingest

torch = pytest.importorskip("torch")
from steplens.collect import attach  # noqa: E402  (after the torch check: the collector needs it)
from steplens.collect.collector import InactiveCollector  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "realrun"))
from read_only import read_only_dir  # noqa: E402  (the path is set just above)


def tiny_model():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model, optimizer) -> float:
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def manifest(run: Path, rank: int = 0) -> dict:
    return json.loads((run / "collector" / "manifest" / f"rank{rank}.json").read_text())


def buffered_rows(collector) -> int:
    return sum(len(rows) for rows in collector.writer.rows.values())


# --- attach never raises ----------------------------------------------------------------------------


def test_a_read_only_run_dir_leaves_the_job_untouched(tmp_path, caplog):
    model, optimizer = tiny_model()
    handler_before = signal.getsignal(signal.SIGTERM)
    with read_only_dir(tmp_path / "ro") as run_dir:
        collector = attach(model, optimizer=optimizer, run_dir=str(run_dir / "exp"), flush_every=1)
        assert isinstance(collector, InactiveCollector) and "exp" in collector.reason
        losses = [train_step(model, optimizer) for _ in range(3)]
        collector.log("train/loss", losses[-1])
        collector.close()
        assert not list(run_dir.iterdir())
    assert all(math.isfinite(x) for x in losses)
    # Nothing of the collector stays in the job: no hooks, the SIGTERM handler as it was.
    assert not model._forward_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert [r.levelname for r in caplog.records if "not attached" in r.getMessage()] == ["ERROR"]


@pytest.mark.parametrize("settings", [{"flush_evry": 5}, {"flush_every": 0}, {"profile": {"repeat": 0}}])
def test_bad_settings_log_and_attach_nothing(tmp_path, settings):
    model, optimizer = tiny_model()
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), **settings)
    assert isinstance(collector, InactiveCollector)
    train_step(model, optimizer)
    assert not model._forward_pre_hooks and not (tmp_path / "collector").exists()


def test_a_model_without_its_optimizer_is_not_an_exception(tmp_path):
    model, _ = tiny_model()
    assert isinstance(attach(model, run_dir=str(tmp_path)), InactiveCollector)


# --- a failed writer ---------------------------------------------------------------------------------


def test_a_failed_writer_stops_buffering_and_counts_what_it_dropped(tmp_path):
    """After the first flush the train_steps folder is replaced by a file (a real OSError on every later
    write, as a full or read-only disk gives). From the moment the job sees the failure, nothing is
    buffered; every row after the first flush is counted as dropped, and analyze says so."""
    model, optimizer = tiny_model()
    flush_every, steps = 2, 40
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=flush_every)
    for _ in range(flush_every):
        collector.log("train/loss", train_step(model, optimizer))
    collector.writer.wait()
    folder = tmp_path / "collector" / "train_steps"
    for part in folder.iterdir():
        part.rename(tmp_path / part.name)  # kept aside, and read back below
    folder.rmdir()
    folder.write_text("in the way")
    buffered, buffered_after_failure = [], []
    for _ in range(steps - flush_every):
        collector.log("train/loss", train_step(model, optimizer))
        buffered.append(buffered_rows(collector))
        if collector.completed_steps == 2 * flush_every:
            collector.writer.wait()  # the failing write is over (steps of microseconds would outrun it)
        if "writer" in collector.disabled:
            buffered_after_failure.append(buffered[-1])
    collector.close()
    # The job sees the failure at the first flush after the background write failed; until then at most
    # flush_every steps of rows (one train_steps row and one scalar each) wait, and none from then on.
    assert max(buffered) <= 2 * flush_every
    assert buffered_after_failure and set(buffered_after_failure) == {0}
    doc = manifest(tmp_path)
    assert "writer" in doc["disabled"] and doc["status"] == "completed"
    assert doc["rows_written"]["train_steps"] == flush_every
    assert doc["dropped_rows"]["train_steps"] == steps - flush_every  # every step after the first flush
    # A step's log() comes after its optimizer step, where the flush runs: the first part has one scalar fewer.
    assert doc["dropped_rows"]["scalars"] == steps - (flush_every - 1)
    assert doc["rows_written"]["scalars"] + doc["dropped_rows"]["scalars"] == steps
    folder.unlink()
    folder.mkdir()
    for part in tmp_path.glob("rank0-*.parquet"):
        part.rename(folder / part.name)
    result = ingest.ingest(tmp_path, jobs=1)
    issues = pl.read_parquet(result.out_dir / "ingest_issues").filter(pl.col("reason") == "collector_rows_dropped")
    # rows the job never wrote are lost data (the verdict says so; analyze exits 1), not a note
    assert issues.select("severity", "count").rows() == [("error", sum(doc["dropped_rows"].values()))]


def test_a_hung_background_write_is_given_up_on(tmp_path):
    """A write that never returns (a hung file system) costs at most WAIT_S at close, then its rows are dropped."""
    from steplens.collect.parts import PartWriter

    release = threading.Event()
    writer = PartWriter(tmp_path, 0, ("scalars",), prepare={})
    writer.add("scalars", {"rank": 0, "name": "x", "value": 1.0})
    writer.last = writer.worker.submit(release.wait)
    writer.wait(timeout_s=0.2)
    assert writer.failure is not None and "0.2 s" in writer.failure
    writer.flush({"status": "completed"}, background=False)
    assert writer.dropped_rows == {"scalars": 1} and buffered_rows_of(writer) == 0
    release.set()
    writer.close()


def job_script(steps: int, flush_every: int) -> str:
    """A training script that attaches the collector to a tiny torch model and runs `steps` steps; the test adds
    what happens next."""
    return f"""
import os, signal, sys, time, torch
from steplens.collect import attach
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
col = attach(model, optimizer=opt, run_dir=sys.argv[1], samples_per_step=8, flush_every={flush_every}, profile=None)
for step in range({steps}):
    model(torch.randn(8, 4)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
"""


HUNG_WRITE_JOB = job_script(4, flush_every=2) + """
started = time.monotonic()
col.close()
print(f"closed {time.monotonic() - started:.1f}", flush=True)
"""


def test_a_job_whose_write_hangs_exits_after_the_bounded_wait(tmp_path):
    """A part write that never returns (a FIFO with no reader where the part is written, as a hung NFS mount
    blocks) made close() give up after WAIT_S as it should, and then the process never exited: the interpreter
    joined the writer's executor thread. It now exits right after close()."""
    import subprocess
    import time

    from steplens.collect.parts import WAIT_S

    (tmp_path / "collector" / "train_steps").mkdir(parents=True)
    os.mkfifo(tmp_path / "collector" / "train_steps" / ".rank0-00000.parquet.tmp")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", HUNG_WRITE_JOB, str(tmp_path)], capture_output=True, text=True,
                          timeout=WAIT_S + 60)
    assert done.returncode == 0, done.stderr
    (closed,) = [line for line in done.stdout.splitlines() if line.startswith("closed ")]  # (deepspeed logs too)
    assert float(closed.split()[1]) <= WAIT_S + 2
    assert time.monotonic() - started < WAIT_S + 40  # not held at exit by the hung thread


def test_a_value_whose_float_overflows_and_cannot_be_compared_costs_that_point_only():
    """Such a value raised TypeError out of as_number's overflow branch, which disabled every scalar after it."""
    from steplens.collect.collector import as_number

    class Weird:
        def __float__(self):
            raise OverflowError("too big")

        def __gt__(self, other):
            raise TypeError("not comparable")

    assert as_number(Weird()) is None and as_number(10**400) == math.inf and as_number(-(10**400)) == -math.inf


def test_a_part_that_fails_is_one_warning_line_without_a_traceback(tmp_path, caplog):
    """A traceback in the job's log reads as the job's crash (analyze called a job that exited 0 failed); the
    warning is one line and where it failed goes to the debug level."""
    import logging

    model, optimizer = tiny_model()
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=100)

    def broken():
        raise RuntimeError("injected")

    with caplog.at_level(logging.DEBUG, logger="steplens.collect"):
        assert collector.guard("timers", broken) is None
    collector.close()
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING and "timers disabled" in r.getMessage()]
    assert warning.exc_info is None and "RuntimeError: injected" in warning.getMessage()
    assert [r.exc_info[0] for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info] == [RuntimeError]
    assert "timers" in manifest(tmp_path)["disabled"]


SIGTERM_IN_CLOSE_JOB = job_script(10, flush_every=1000) + """
flush = col.writer.flush
def flush_after_a_sigterm(*args, **kwargs):  # the launcher's SIGTERM lands in close()'s last flush
    os.kill(os.getpid(), signal.SIGTERM)
    return flush(*args, **kwargs)
col.writer.flush = flush_after_a_sigterm
col.close()
print("after close", flush=True)
"""


def test_a_sigterm_during_close_is_handed_on_after_the_last_flush(tmp_path):
    """close() put the default SIGTERM handler back before its last flush: a SIGTERM then (a launcher stopping the
    job) lost every unflushed step and left the manifest 'running'. The job still dies by it, once all is written."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", SIGTERM_IN_CLOSE_JOB, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "after close" not in done.stdout
    doc = manifest(tmp_path)
    assert doc["status"] == "terminated" and doc["steps_completed"] == 10
    steps = pl.read_parquet(tmp_path / "collector" / "train_steps" / "*.parquet")
    assert sorted(steps["step"].to_list()) == list(range(10))


def test_the_manifest_names_only_steps_whose_rows_were_written(tmp_path):
    """After a write that failed the manifest still said last_flushed_step=3 with no row written; a job with no
    step said -1; a point logged before the first step was step -1. Each is null: no step is -1."""
    model, optimizer = tiny_model()
    blocked = tmp_path / "blocked"
    collector = attach(model, optimizer=optimizer, run_dir=str(blocked), flush_every=2)
    (blocked / "collector" / "train_steps").write_text("a file where the table's folder goes")
    for _ in range(4):
        train_step(model, optimizer)
    collector.close()
    doc = manifest(blocked)
    assert doc["steps_completed"] == 4 and doc["rows_written"]["train_steps"] == 0
    assert doc["last_flushed_step"] is None and doc["dropped_rows"]["train_steps"] == 4

    model, optimizer = tiny_model()
    idle = tmp_path / "idle"
    collector = attach(model, optimizer=optimizer, run_dir=str(idle), flush_every=2)
    collector.log("train/loss", 1.0)  # before any step
    collector.close()
    assert manifest(idle)["last_flushed_step"] is None
    scalars = pl.read_parquet(idle / "collector" / "scalars" / "*.parquet")
    assert scalars.filter(pl.col("name") == "train/loss")["step"].to_list() == [None]


def buffered_rows_of(writer) -> int:
    return sum(len(rows) for rows in writer.rows.values())


# --- values that are not numbers ------------------------------------------------------------------------


def test_a_value_that_is_not_a_number_costs_that_point_only(tmp_path):
    import numpy as np

    model, optimizer = tiny_model()
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=100)
    train_step(model, optimizer)
    logged = [("v", 1.5), ("v", "abc"), ("v", None), ("v", [1.0, 2.0]), ("v", math.nan), ("v", math.inf),
              ("v", -math.inf), ("v", torch.tensor(2.0)), ("v", torch.tensor([1.0, 2.0])), ("v", np.float32(0.25)),
              ("v", 10**400), ("v", -(10**400)), ("v", "2.0"), ("v", True), ("w", object()), ("w", 3)]
    for name, value in logged:
        collector.log(name, value)
    collector.close()
    # By hand: numbers (NaN and inf among them) are kept in order, everything else dropped and counted.
    expected = [1.5, math.nan, math.inf, -math.inf, 2.0, 0.25, math.inf, -math.inf, 1.0]
    doc = manifest(tmp_path)
    assert doc["rejected_values"] == {"v": 5, "w": 1} and "scalars" not in doc["disabled"]
    result = ingest.ingest(tmp_path, jobs=1)
    scalars = pl.read_parquet(result.out_dir / "scalars").sort("wall_ns", maintain_order=True)
    got = scalars.filter(pl.col("name") == "v")["value"].to_list()
    assert len(got) == len(expected)
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, expected))
    assert scalars.filter(pl.col("name") == "w")["value"].to_list() == [3.0]
    (issue,) = pl.read_parquet(result.out_dir / "ingest_issues").filter(
        pl.col("reason") == "collector_values_rejected").rows(named=True)
    assert issue["count"] == 6 and issue["severity"] == "warning"


# --- SIGTERM -----------------------------------------------------------------------------------------


def test_sigterm_flushes_marks_terminated_and_calls_the_previous_handler(tmp_path):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        model, optimizer = tiny_model()
        ours_before = signal.getsignal(signal.SIGTERM)
        collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=100)
        assert signal.getsignal(signal.SIGTERM) == collector.on_sigterm
        for _ in range(3):
            train_step(model, optimizer)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this thread before kill returns to us
        assert received == [signal.SIGTERM]
        doc = manifest(tmp_path)
        assert doc["status"] == "terminated" and doc["steps_completed"] == 3 and doc["last_flushed_step"] == 2
        steps = pl.read_parquet(tmp_path / "collector" / "train_steps")
        assert steps["step"].to_list() == [0, 1, 2]
        collector.close()
        assert manifest(tmp_path)["status"] == "terminated"  # close keeps it
        assert signal.getsignal(signal.SIGTERM) is ours_before  # restored on close
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_handler_is_installed_from_the_main_thread_only(tmp_path):
    model, optimizer = tiny_model()
    before = signal.getsignal(signal.SIGTERM)
    made = []
    thread = threading.Thread(target=lambda: made.append(attach(model, optimizer=optimizer, run_dir=str(tmp_path))))
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is before and made[0].status == "running"
    made[0].close()


def test_a_job_that_ignores_sigterm_keeps_ignoring_it(tmp_path):
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        model, optimizer = tiny_model()
        collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        collector.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- names that are not names (issue 37) -------------------------------------------------------------------


def test_a_bad_scalar_name_costs_that_point_only(tmp_path, capfd):
    """log(("a",), x), log(None, x), log(3, x) and a name with a lone surrogate: each point is dropped and counted,
    the good train/loss points of every step survive, the writer and the alarms stay on, and no traceback."""
    model, optimizer = tiny_model()
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=2)
    losses = []
    for step in range(6):
        losses.append(train_step(model, optimizer))
        collector.log("train/loss", losses[-1])
        collector.log(("a",), 1.0)
        collector.log(None if step % 2 else 3, 2.0)
        collector.log("bad\ud800name", 3.0)
    collector.log("train/loss", math.nan)  # the non-finite-loss alarm still watches
    collector.close()
    doc = manifest(tmp_path)
    assert doc["disabled"] == {} and doc["alarms"] is not None
    assert doc["rejected_values"] == {"<name of type tuple>": 6, "<name of type NoneType>": 3,
                                      "<name of type int>": 3, "<name of type str>": 6}
    result = ingest.ingest(tmp_path, jobs=1)
    scalars = pl.read_parquet(result.out_dir / "scalars").sort("wall_ns", maintain_order=True)
    got = scalars.filter(pl.col("name") == "train/loss")["value"].to_list()
    assert got[:-1] == losses and math.isnan(got[-1])
    assert set(scalars["name"]) == {"train/loss"}
    alarms = pl.read_parquet(tmp_path / "collector" / "alarms")
    assert alarms["rule"].to_list() == ["nonfinite"]
    (issue,) = pl.read_parquet(result.out_dir / "ingest_issues").filter(
        pl.col("reason") == "collector_values_rejected").rows(named=True)
    assert issue["count"] == 18
    assert "Traceback" not in capfd.readouterr().err


# --- collector edges (issue 37) ---------------------------------------------------------------------------


def test_a_run_dir_that_is_a_file_is_one_line(tmp_path):
    """Logged in a fresh interpreter (the job's log as it would read): one line, no traceback."""
    import subprocess

    in_the_way = tmp_path / "run"
    in_the_way.write_text("a file, not a folder")
    script = ("import logging, torch; logging.basicConfig(); from steplens.collect import attach\n"
              "m = torch.nn.Linear(2, 2); c = attach(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), "
              f"run_dir={str(in_the_way)!r}); print(type(c).__name__)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "InactiveCollector"
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not attached" in lines[0] and str(in_the_way) in lines[0], done.stderr
    assert in_the_way.read_text() == "a file, not a folder"


def test_a_forked_child_that_exits_does_not_wait_for_the_parents_writer(tmp_path):
    # Asserted by what the child does, not by a wall-clock bound (fork + exit of a large process is slow on a
    # loaded machine): at exit the child neither waits on the parent's writer nor closes the parent's collector.
    model, optimizer = tiny_model()
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=1)
    train_step(model, optimizer)
    release = threading.Event()
    collector.writer.last = collector.writer.worker.submit(release.wait)  # the parent's writer is busy
    touched = tmp_path / "child_touched_the_parents_collector"
    pid = os.fork()
    if pid == 0:  # the child exits the way a script does: atexit handlers run
        import atexit

        def record(*_args, **_kwargs):
            touched.write_text("yes")

        collector.writer.wait = record
        collector.close = record
        atexit._run_exitfuncs()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    release.set()
    collector.close()
    assert os.waitstatus_to_exitcode(status) == 0
    assert not touched.exists()
    assert manifest(tmp_path)["status"] == "completed" and manifest(tmp_path)["steps_completed"] == 1


def test_a_second_attach_returns_the_first_collector(tmp_path, caplog):
    model, optimizer = tiny_model()
    first = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=1)
    second = attach(model, optimizer=optimizer, run_dir=str(tmp_path / "other"), flush_every=1)
    assert second is first
    assert [r.levelname for r in caplog.records if "already attached" in r.getMessage()] == ["WARNING"]
    for _ in range(3):
        train_step(model, optimizer)
    first.close()
    assert not (tmp_path / "other").exists()
    steps = pl.read_parquet(tmp_path / "collector" / "train_steps")
    assert steps["step"].to_list() == [0, 1, 2]  # one row per step: one collector's hooks
    # Closed, it is off the model: a new attach starts a new collector.
    third = attach(model, optimizer=optimizer, run_dir=str(tmp_path / "again"))
    assert third is not first and third.status == "running"
    third.close()


def test_a_model_with_a_collector_can_still_be_deep_copied(tmp_path):
    """An EMA copy (copy.deepcopy(model)) after attach: the collector is not part of the model."""
    import copy

    model, optimizer = tiny_model()
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path))
    ema = copy.deepcopy(model)
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), model.parameters()))
    collector.close()


HOLD_RANK_0 = """
import sys, time
from pathlib import Path
from steplens.collect.parts import FolderLock
lock = FolderLock(Path(sys.argv[1]) / "collector", 0)
print("holding", lock.other_writer, flush=True)
time.sleep(120)
"""


def test_a_second_job_into_a_folder_another_job_writes_writes_nothing(tmp_path, caplog):
    """Two jobs started into one folder both numbered their parts from 0 and replaced each other's files. A rank
    whose files another live process writes writes nothing, profiler traces included, and says so once; a killed
    job leaves no lock behind."""
    import logging
    import subprocess

    from steplens.collect.parts import FolderLock

    (tmp_path / "collector" / "manifest").mkdir(parents=True)
    first = subprocess.Popen([sys.executable, "-c", HOLD_RANK_0, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().split() == ["holding", "None"]
        model, optimizer = tiny_model()
        with caplog.at_level(logging.WARNING, logger="steplens.collect"):
            collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=1,
                               profile={"skip_first": 0, "wait": 0, "warmup": 0, "active": 1, "repeat": 1})
            losses = [train_step(model, optimizer) for _ in range(3)]
            collector.close()
        assert all(math.isfinite(x) for x in losses)
        written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith(".")]
        assert written == [], "the second job wrote into the first one's folder"
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(said) == 1 and f"pid {first.pid}" in said[0] and "rank 0 stops writing" in said[0], said
        # the holder's pid is this process's on another host (containers on one shared mount): not this process
        lock = tmp_path / "collector" / "manifest" / ".rank0.lock"
        lock.write_text(json.dumps({"pid": os.getpid(), "hostname": "another-host"}))
        assert FolderLock(tmp_path / "collector", 0).other_writer is not None
    finally:
        first.kill()
        first.wait()
    after = FolderLock(tmp_path / "collector", 0)  # the first job was killed: its lock went with it
    assert after.other_writer is None and after.fd is not None
    after.release()


def test_a_file_system_without_flock_writes_unlocked(tmp_path, monkeypatch):
    """Lustre without -o flock answers ENOSYS, NFS without its lock daemon ENOLCK: the collector did not attach."""
    import errno

    from steplens.collect import parts

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(parts.fcntl, "flock", no_flock)
    model, optimizer = tiny_model()
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), flush_every=1)
    assert not isinstance(collector, InactiveCollector)
    [train_step(model, optimizer) for _ in range(2)]
    collector.close()
    assert manifest(tmp_path)["status"] == "completed" and manifest(tmp_path)["rows_written"]["train_steps"] == 2


def test_a_lock_file_that_is_a_link_or_a_fifo_is_not_followed_or_waited_on(tmp_path):
    """The lock is written to: one linked to another file would have truncated that file, and reading a FIFO in its
    place would hang the job's start."""
    from steplens.collect.parts import FolderLock

    manifest_dir = tmp_path / "collector" / "manifest"
    manifest_dir.mkdir(parents=True)
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    (manifest_dir / ".rank0.lock").symlink_to(precious)
    os.mkfifo(manifest_dir / ".rank1.lock")
    lock = FolderLock(tmp_path / "collector", 0)
    assert lock.other_writer is None and lock.fd is None
    fifo = FolderLock(tmp_path / "collector", 1)  # no wait on the FIFO
    assert fifo.other_writer is None and fifo.fd is None
    assert precious.read_text() == "keep me"
