"""Nsight Systems SQLite exports: real exports of three nsys versions (tests/fixtures/nsys/README.md),
every figure checked against SQL over the same file written here (it shares no code with the importer),
and small exports built here with nsys's table and column names for the cases the real ones lack
(steps, NCCL payloads, ranks, several processes, schema gaps)."""

import json
import sqlite3
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from steplens.analyze.cli import analyze
from steplens.analyze.importers import nsys
from steplens.analyze.pipeline.ingest import ingest, read_trace

FIXTURES = Path(__file__).parent / "fixtures" / "nsys"
DLPROF = FIXTURES / "dlprof_pytorch_2022.1.sqlite"
CUDAHW = FIXTURES / "cudahw_uvm_2022.2.sqlite"
UVMTORCH = FIXTURES / "uvmtorch_2025.3.sqlite"
NVFUSER = FIXTURES / "nvfuser_h200_2025.1.sqlite"


def _sql(path: Path, query: str, *args) -> list[tuple]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute(query, args).fetchall()
    finally:
        db.close()


def _table(out: Path, table: str) -> pl.DataFrame:
    return pl.read_parquet(out / table / "**" / "*.parquet", hive_partitioning=True)


def _run_with(tmp_path: Path, *exports: Path, names: tuple[str, ...] = ()) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    for i, export in enumerate(exports):
        (run / (names[i] if names else export.name)).write_bytes(export.read_bytes())
    return run


# ---------------------------------------------------------------------------------------------
# Real exports, checked against our own SQL


@pytest.mark.parametrize("export", [DLPROF, CUDAHW, NVFUSER])
def test_kernel_time_per_name_is_exact(export, tmp_path):
    run = _run_with(tmp_path, export)
    ingest(run, jobs=1)
    events = _table(run / ".steplens", "trace_events")
    ours = dict(events.filter(pl.col("kind") == "kernel").group_by("name").agg(pl.col("dur_ns").sum()).iter_rows())
    theirs = dict(_sql(export, "SELECT s.value, SUM(k.end - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                               "JOIN StringIds s ON s.id = k.demangledName GROUP BY s.value"))
    assert ours == theirs and theirs
    # Times are the session start (UTC epoch ns) plus the export's ns, to the ns
    (base,) = _sql(export, "SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME")[0]
    starts = sorted(base + s for (s,) in _sql(export, "SELECT start FROM CUPTI_ACTIVITY_KIND_KERNEL"))
    assert sorted(events.filter(pl.col("kind") == "kernel")["ts_ns"].to_list()) == starts


@pytest.mark.parametrize("export", [DLPROF, CUDAHW, NVFUSER])
def test_launch_links_are_the_exports_correlations(export, tmp_path):
    run = _run_with(tmp_path, export)
    ingest(run, jobs=1)
    out = run / ".steplens"
    events, flows = _table(out, "trace_events"), _table(out, "flows")
    (base,) = _sql(export, "SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME")[0]
    ts = dict(events.select("event_id", "ts_ns").iter_rows())
    ours = sorted((ts[src] - base, ts[dst] - base) for src, dst in
                  flows.filter(pl.col("flow_type") == "launch").select("src_event_id", "dst_event_id").iter_rows())
    device_tables = [t for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")
                     if _sql(export, "SELECT count(*) FROM sqlite_master WHERE name = ?", t)[0][0]]
    theirs = sorted(pair for t in device_tables for pair in _sql(
        export, f"SELECT r.start, d.start FROM {t} d JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = d.correlationId"))
    assert ours == theirs and theirs
    orphans = sum(_sql(export, f"SELECT count(*) FROM {t} d WHERE NOT EXISTS (SELECT 1 FROM CUPTI_ACTIVITY_KIND_RUNTIME r "
                               "WHERE r.correlationId = d.correlationId)")[0][0] for t in device_tables)
    issues = _table(out, "ingest_issues")
    counted = issues.filter(pl.col("reason") == "orphan_device_activity")["count"].sum()
    assert counted == orphans  # CUDAHW: 48 unified-memory migrations, which no call launched


def _busy_union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def test_a_helper_process_that_ran_no_device_work_is_no_rank(tmp_path):
    """nvFuser's benchmark under nsys 2025.1 on an H200: the benchmark process ran every kernel; a second process
    (pytest's) made two CUDA calls and ran nothing. One rank, the benchmark's; the other's events counted."""
    run = _run_with(tmp_path, NVFUSER)
    ingest(run, jobs=1)
    out = run / ".steplens"
    manifest = json.loads((out / "run.json").read_text())
    (source,) = manifest["sources"]
    assert (source["rank"], source["status"]) == (0, "ingested")
    assert manifest["environment"]["device_names"] == ["NVIDIA H200"]
    pid_of = "(globalTid >> 24) & 16777215"
    calls = dict(_sql(NVFUSER, f"SELECT {pid_of}, count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME GROUP BY 1"))
    (worker,) = {pid for (pid,) in _sql(NVFUSER, "SELECT DISTINCT (globalPid >> 24) & 16777215 FROM CUPTI_ACTIVITY_KIND_KERNEL")}
    events = _table(out, "trace_events")
    api = events.filter(pl.col("kind").is_in(["cuda_runtime", "cuda_driver"]))
    assert api.height == calls[worker] and set(api["pid"].to_list()) == {worker}
    others = sum(n for pid, n in calls.items() if pid != worker) + _sql(
        NVFUSER, f"SELECT count(*) FROM NVTX_EVENTS WHERE {pid_of} != ?", worker)[0][0]
    issues = _table(out, "ingest_issues").filter(pl.col("reason") == "several_processes")
    assert issues["count"].to_list() == [others] and others > 0


def test_gpu_idle_of_a_real_export_matches_our_sql(tmp_path):
    run = _run_with(tmp_path, DLPROF)
    result = CliRunner().invoke(analyze, [str(run), "-q", "--jobs", "1"])
    assert result.exit_code == 0, result.output
    idle = _table(run / ".steplens", "gpu_idle").filter((pl.col("stream") == -1) & pl.col("step").is_null())
    intervals = [row for t in ("KERNEL", "MEMCPY", "MEMSET")
                 for row in _sql(DLPROF, f"SELECT start, end FROM CUPTI_ACTIVITY_KIND_{t}")]
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    assert idle.select("span_ns", "busy_ns", "idle_ns").row(0) == (span, _busy_union(intervals), span - _busy_union(intervals))
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    (source,) = manifest["sources"]
    assert source["kind"] == "nsys" and source["status"] == "ingested"
    assert manifest["environment"]["device_names"] == ["NVIDIA GeForce RTX 2070 SUPER"]
    assert manifest["environment"]["device_sms"] == [40]
    assert source["trace_meta"]["schema_version"] == "2.9.1"


def test_api_names_lose_the_callback_version_and_sync_events_are_named(tmp_path):
    parsed = read_trace(DLPROF, "x")
    runtime = parsed.events.filter(pl.col("kind") == "cuda_runtime")
    ours = dict(runtime.group_by("name").len().iter_rows())
    theirs = dict(_sql(DLPROF, "SELECT s.value, count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON s.id = r.nameId "
                               "GROUP BY s.value"))
    assert ours == {name.rsplit("_v", 1)[0]: n for name, n in theirs.items()}
    assert ours["cudaStreamSynchronize"] == 11 and ours["cudaLaunchKernel"] == 46
    syncs = parsed.events.filter(pl.col("cat") == "cuda_sync")
    assert dict(syncs.group_by("name").len().iter_rows()) == {
        {1: "Event sync", 2: "Stream wait sync", 3: "Stream sync", 4: "Context sync"}[t]: n
        for t, n in _sql(DLPROF, "SELECT syncType, count(*) FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION GROUP BY 1")}
    nvtx = parsed.events.filter(pl.col("kind") == "user_annotation")
    assert nvtx.height == _sql(DLPROF, "SELECT count(*) FROM NVTX_EVENTS WHERE eventType = 59")[0][0]
    assert nvtx["dur_ns"].sum() == _sql(DLPROF, "SELECT SUM(end - start) FROM NVTX_EVENTS WHERE eventType = 59")[0][0]


def test_a_2025_export_with_no_device_work(tmp_path):
    parsed = read_trace(UVMTORCH, "x")
    assert dict(parsed.events.group_by("kind").len().iter_rows()) == {"cuda_runtime": 1, "cuda_driver": 1}
    (device,) = parsed.meta.devices
    name, sms, memory, clock_hz = _sql(UVMTORCH, "SELECT name, smCount, totalMemory, clockRate FROM TARGET_INFO_GPU")[0]
    assert (device.name, device.sm_count, device.memory_bytes, device.clock_khz) == (name, sms, memory, clock_hz // 1000)
    assert parsed.meta.producer_version == "2025.3.2.367"
    assert parsed.meta.rank is None and parsed.meta.world_size is None  # its captured environment has no RANK


# ---------------------------------------------------------------------------------------------
# Exports built here, with nsys's table and column names (Nsight Systems SQLite Schema Reference)

SESSION_START_NS = 1_700_000_000_123_456_789  # beyond float64's exact integers: any float step shows
PID, TID = 4242, 4243


def _global_id(pid: int, tid: int = 0) -> int:
    return (1 << 48) | (pid << 24) | tid  # how nsys serializes (vm, pid, tid)


def _build_export(path: Path, *, env: dict | None = None, second_process: bool = False, old_schema: bool = False,
                  nccl_payload: bool = True, step_names=("iteration 1", "iteration 2"), collective: str = "AllReduce") -> Path:
    db = sqlite3.connect(path)
    nccl_kernel = f"ncclDevKernel_{collective}_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    strings = ["gemm_kernel(float*)", nccl_kernel, "cudaLaunchKernel_v7000", "cudaLaunchKernelExC_v11060",
               "cudaStreamSynchronize_v3020", "cudaMemcpyAsync_v3020", "cuLaunchKernel", "gemm_kernel",
               nccl_kernel.split("(")[0]]
    sid = {s: i for i, s in enumerate(strings)}
    db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", list(enumerate(strings)))
    db.execute("CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER, utcTime TEXT, localTime TEXT)")
    db.execute("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, '2023-11-14T22:13:20', '')", (SESSION_START_NS,))
    db.execute("CREATE TABLE TARGET_INFO_GPU (id INTEGER, name TEXT, totalMemory INTEGER, smCount INTEGER, clockRate INTEGER, "
               "computeMajor INTEGER, computeMinor INTEGER, cuDevice INTEGER)")
    db.execute("INSERT INTO TARGET_INFO_GPU VALUES (0, 'NVIDIA H100 80GB HBM3', 85045870592, 132, 1980000000, 9, 0, 0)")
    kernel_names = "shortName" if old_schema else "demangledName, shortName, mangledName"
    db.execute(f"CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, contextId INTEGER, "
               f"streamId INTEGER, correlationId INTEGER, globalPid INTEGER, {kernel_names})")
    runtime_class = "" if old_schema else ", eventClass"
    db.execute(f"CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, globalTid INTEGER, correlationId INTEGER, "
               f"nameId INTEGER, returnValue INTEGER{runtime_class})")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER, end INTEGER, deviceId INTEGER, contextId INTEGER, "
               "streamId INTEGER, correlationId INTEGER, globalPid INTEGER, bytes INTEGER, copyKind INTEGER)")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_SYNCHRONIZATION (start INTEGER, end INTEGER, deviceId INTEGER, contextId INTEGER, "
               "streamId INTEGER, correlationId INTEGER, globalPid INTEGER, syncType INTEGER, eventId INTEGER)")
    db.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, rangeId INTEGER, category INTEGER, "
               "color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, "
               "uint64Value INTEGER, int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER, "
               "floatValue REAL, jsonTextId INTEGER, jsonText TEXT)")
    if env is not None:
        db.execute("CREATE TABLE META_DATA_CAPTURE (name TEXT, value TEXT)")
        db.executemany("INSERT INTO META_DATA_CAPTURE VALUES ('PROCESS_0:ENVIRONMENT_VARIABLE', ?)",
                       [(f'{k}="{v}"',) for k, v in env.items()])

    def process(pid: int, offset: int, correlation: int) -> None:
        thread, gpid = _global_id(pid, pid + 1), _global_id(pid)

        def kernel(start, end, stream, corr, name):
            names = (sid[name.split("(")[0]],) if old_schema else (sid[name], sid[name], sid[name])
            db.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, ?, ?, ?, {', '.join('?' * len(names))})",
                       (start + offset, end + offset, stream, corr + correlation, gpid, *names))

        def call(start, end, corr, name, event_class=0):
            extra = () if old_schema else (event_class,)
            db.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, ?, ?, ?, 0{', ?' if extra else ''})",
                       (start + offset, end + offset, thread, corr + correlation, sid[name], *extra))

        def nvtx(start, end, event_type, text, domain=0, payload=None):
            db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, domainId, jsonText) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?)", (start + offset, end if end is None else end + offset, event_type,
                                                        text, thread, domain, payload))

        nvtx(0, None, 75, "NCCL", domain=1)  # NvtxDomainCreate
        nvtx(1000, 5000, 59, step_names[0])
        nvtx(5000, 9000, 59, step_names[1])
        call(1100, 1200, 1, "cudaLaunchKernel_v7000")
        kernel(1300, 2300, 7, 1, "gemm_kernel(float*)")
        payload = json.dumps({nsys.NCCL_SIZE_KEY: 1 << 20}) if nccl_payload else None
        nvtx(2400, 2600, 59, f"nccl{collective}", domain=1, payload=payload)
        call(2450, 2500, 2, "cudaLaunchKernelExC_v11060")
        kernel(2600, 4600, 13, 2, nccl_kernel)
        call(5100, 5200, 3, "cuLaunchKernel", event_class=1)
        kernel(5300, 6300, 7, 3, "gemm_kernel(float*)")
        call(6000, 6400, 4, "cudaStreamSynchronize_v3020")
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_SYNCHRONIZATION VALUES (?, ?, 0, 1, 7, ?, ?, 3, 0)",
                   (6300 + offset, 6400 + offset, 4 + correlation, gpid))
        call(6500, 6600, 5, "cudaMemcpyAsync_v3020")
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?, ?, 0, 1, 7, ?, ?, 4096, 2)",
                   (6700 + offset, 6800 + offset, 5 + correlation, gpid))
        nvtx(8000, None, 34, "checkpoint")  # NvtxMark

    process(PID, 0, 0)
    if second_process:
        process(PID + 100, 10, 1000)
    db.commit()
    db.close()
    return path


def test_built_export_maps_every_table(tmp_path):
    parsed = read_trace(_build_export(tmp_path / "a.sqlite"), "a.sqlite")
    events = parsed.events
    kernels = events.filter(pl.col("kind") == "kernel").sort("ts_ns")
    assert kernels.select("ts_ns", "dur_ns", "stream", "device", "step").rows() == [
        (SESSION_START_NS + 1300, 1000, 7, 0, 1), (SESSION_START_NS + 2600, 2000, 13, 0, 1), (SESSION_START_NS + 5300, 1000, 7, 0, 2)]
    assert kernels["name"][0] == "gemm_kernel(float*)"  # the demangled name
    calls = events.filter(pl.col("kind").is_in(["cuda_runtime", "cuda_driver"])).sort("ts_ns")
    assert calls.select("kind", "name", "pid", "tid", "is_launch").rows() == [
        ("cuda_runtime", "cudaLaunchKernel", PID, PID + 1, True), ("cuda_runtime", "cudaLaunchKernelExC", PID, PID + 1, True),
        ("cuda_driver", "cuLaunchKernel", PID, PID + 1, True), ("cuda_runtime", "cudaStreamSynchronize", PID, PID + 1, False),
        ("cuda_runtime", "cudaMemcpyAsync", PID, PID + 1, True)]
    memcpy = events.filter(pl.col("kind") == "gpu_memcpy")
    assert memcpy.select("name", "bytes", "step").row(0) == ("Memcpy Device-to-Host", 4096, 2)
    assert parsed.steps.select("step", "start_ns", "dur_ns").rows() == [(1, SESSION_START_NS + 1000, 4000),
                                                                       (2, SESSION_START_NS + 5000, 4000)]
    marks = events.filter(pl.col("ph") == "i")
    assert marks.select("name", "ts_ns", "dur_ns").rows() == [("checkpoint", SESSION_START_NS + 8000, None)]
    nccl_range = events.filter(pl.col("name") == "ncclAllReduce")
    assert nccl_range.select("cat", "kind", "dur_ns").row(0) == ("NCCL", "user_annotation", 200)
    assert parsed.flows.filter(pl.col("flow_type") == "launch").height == 4
    assert parsed.meta.devices[0].sm_count == 132


def test_nccl_payload_gives_the_collective_its_bytes(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _build_export(run / "report_rank1.sqlite")
    result = CliRunner().invoke(analyze, [str(run), "-q", "--jobs", "1"])
    assert result.exit_code == 0, result.output
    collectives = _table(run / ".steplens", "collectives")
    row = collectives.select("op", "bytes", "dur_ns", "step").row(0, named=True)
    assert row == {"op": "allreduce", "bytes": 1 << 20, "dur_ns": 2000, "step": 1}
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    (source,) = manifest["sources"]
    assert (source["rank"], source["rank_origin"]) == (1, "file name")


@pytest.mark.parametrize("collective, op, total_bytes, factor", [
    ("AllReduce", "allreduce", 1 << 20, 2 * 3 / 4),  # nccl-tests: S = the buffer; busbw = algbw * 2(n-1)/n
    ("ReduceScatter", "reducescatter", 4 << 20, 3 / 4),  # NCCL's payload is recvcount's bytes: S = n times it
    ("AllGather", "allgather", 4 << 20, 3 / 4),  # sendcount's bytes: S = n times it
])
def test_nccl_sizes_follow_nccl_tests_definitions(tmp_path, collective, op, total_bytes, factor):
    run = tmp_path / "run"
    run.mkdir()
    _build_export(run / "profile.sqlite", env={"RANK": "0", "WORLD_SIZE": "4"}, collective=collective)
    assert CliRunner().invoke(analyze, [str(run), "-q", "--jobs", "1"]).exit_code == 0
    row = _table(run / ".steplens", "collectives").row(0, named=True)
    assert (row["op"], row["bytes"]) == (op, total_bytes)
    assert row["busbw_gbps"] == pytest.approx(total_bytes / 2000 * factor)  # bytes/ns = GB/s over the kernel's 2000 ns


def test_nccl_kernel_without_payload_has_unknown_size(tmp_path):
    parsed = read_trace(_build_export(tmp_path / "a.sqlite", nccl_payload=False), "a.sqlite")
    nccl = parsed.events.filter(pl.col("name").str.starts_with("ncclDevKernel"))
    assert nccl.select("collective", "in_nelems", "dtype").row(0) == ("AllReduce", None, None)


def test_rank_from_the_captured_environment(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _build_export(run / "profile.sqlite", env={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"})
    ingest(run, jobs=1)
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    (source,) = manifest["sources"]
    assert (source["rank"], source["rank_origin"], source["world_size"]) == (3, "distributedInfo", 4)


def test_step_range_option_names_other_ranges(tmp_path, monkeypatch):
    export = _build_export(tmp_path / "a.sqlite", step_names=("fwd-bwd 10", "fwd-bwd 11"))
    assert read_trace(export, "a").steps.is_empty()  # not a default step name: the whole window
    monkeypatch.setenv(nsys.STEP_RANGE_ENV, r"^fwd-bwd (\d+)$")
    assert read_trace(export, "a").steps["step"].to_list() == [10, 11]


def test_step_range_flag_reparses_and_rejects_a_pattern_without_a_group(tmp_path, monkeypatch):
    monkeypatch.setenv(nsys.STEP_RANGE_ENV, "")  # restored after the test: the CLI sets it for its workers
    run = tmp_path / "run"
    run.mkdir()
    _build_export(run / "a.sqlite", step_names=("fwd-bwd 10", "fwd-bwd 11"))
    assert CliRunner().invoke(analyze, [str(run), "-q", "--jobs", "1", "--ingest-only"]).exit_code == 0
    assert _table(run / ".steplens", "steps").is_empty()
    result = CliRunner().invoke(analyze, [str(run), "-q", "--jobs", "1", "--ingest-only", "--step-range", r"^fwd-bwd (\d+)$"])
    assert result.exit_code == 0, result.output
    assert sorted(_table(run / ".steplens", "steps")["step"].to_list()) == [10, 11]  # not the parts parsed without it
    bad = CliRunner().invoke(analyze, [str(run), "--step-range", "fwd-bwd"])
    assert bad.exit_code != 0 and "needs a group" in bad.output
    # Python's re takes a look-behind; the analyses' engine does not: refused up front, not a lost export
    behind = CliRunner().invoke(analyze, [str(run), "--step-range", r"(?<=fwd-bwd )(\d+)"])
    assert behind.exit_code == 2 and "Rust's regex crate" in " ".join(behind.output.split())
    # a group that captures a name, not digits, is named as such
    named = CliRunner().invoke(analyze, [str(run), "-q", "--jobs", "1", "--ingest-only", "--step-range", r"^(fwd-bwd) \d+$"])
    assert named.exit_code == 0, named.output
    [issue] = [i for i in pl.read_parquet(run / ".steplens" / "ingest_issues").to_dicts() if i["reason"] == "bad_step_number"]
    assert issue["count"] == 2 and "captured 'fwd-bwd', not a step number" in issue["detail"]


def test_an_older_schema_is_read_and_its_gaps_counted(tmp_path):
    parsed = read_trace(_build_export(tmp_path / "a.sqlite", old_schema=True), "a")
    kernels = parsed.events.filter(pl.col("kind") == "kernel")
    assert sorted(kernels["name"].to_list()) == ["gemm_kernel", "gemm_kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"]
    # without eventClass, the driver API is told by its name
    assert parsed.events.filter(pl.col("name") == "cuLaunchKernel")["kind"].to_list() == ["cuda_driver"]
    gaps = [i for i in parsed.issues if i.reason == "nsys_schema_gap"]
    assert len(gaps) == 1 and "CUPTI_ACTIVITY_KIND_RUNTIME without eventClass" in gaps[0].detail


def test_nvtx_domains_and_categories_name_the_category(tmp_path):
    export = _build_export(tmp_path / "a.sqlite")
    db = sqlite3.connect(export)
    thread = _global_id(PID, PID + 1)
    db.execute("INSERT INTO NVTX_EVENTS (start, eventType, text, category, domainId) VALUES (0, 33, 'optimizer', 5, 0)")
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, category, globalTid, domainId) "
               "VALUES (7000, 7100, 59, 'adam', 5, ?, 0), (7200, 7300, 60, 'allreduce wait', 5, ?, 1)", (thread, thread))
    db.commit()
    db.close()
    cats = dict(read_trace(export, "a").events.filter(pl.col("kind") == "user_annotation").select("name", "cat").iter_rows())
    # category 5 is named in the default domain only; the NCCL domain's range keeps its domain alone
    assert cats == {"iteration 1": "NVTX", "iteration 2": "NVTX", "ncclAllReduce": "NCCL", "adam": "NVTX:optimizer",
                    "allreduce wait": "NCCL", "checkpoint": "NVTX"}


def test_unclosed_nvtx_ranges_are_counted(tmp_path):
    export = _build_export(tmp_path / "a.sqlite")
    db = sqlite3.connect(export)
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (9500, NULL, 59, 'open', ?)",
               (_global_id(PID, PID + 1),))
    db.commit()
    db.close()
    parsed = read_trace(export, "a")
    assert [(i.reason, i.count) for i in parsed.issues if i.reason == "missing_duration"] == [("missing_duration", 1)]
    assert parsed.events.filter(pl.col("name") == "open")["dur_ns"].to_list() == [None]


def test_several_processes_are_one_rank_each(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    export = _build_export(run / "node0.sqlite", second_process=True)
    db = sqlite3.connect(export)  # the launcher (torchrun): an NVTX range, no CUDA work
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (0, 99999, 59, 'launch', ?)",
               (_global_id(99, 99),))
    db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET deviceId = 1 WHERE globalPid = ?", (_global_id(PID),))
    db.execute("UPDATE CUPTI_ACTIVITY_KIND_MEMCPY SET deviceId = 1 WHERE globalPid = ?", (_global_id(PID),))
    db.commit()
    db.close()
    ingest(run, jobs=1)
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    ranks = {s["rank"]: s for s in manifest["sources"]}
    # ranks in the order of the GPU each process used: PID + 100 ran on GPU 0, PID on GPU 1
    assert {r: (s["unit"], s["rank_origin"], s["status"]) for r, s in ranks.items()} == {
        0: (f"process {PID + 100}", "process in file", "ingested"), 1: (f"process {PID}", "process in file", "ingested")}
    events = _table(run / ".steplens", "trace_events")
    runtime_pids = dict(events.filter(pl.col("kind") == "cuda_runtime").group_by("rank").agg(pl.col("pid").unique()).iter_rows())
    assert runtime_pids == {0: [PID + 100], 1: [PID]}
    # each rank's own kernels, times and steps: the second process runs 10 ns later
    kernels = events.filter(pl.col("kind") == "kernel").sort("rank", "ts_ns")
    assert kernels.select("rank", "ts_ns", "step", "device").rows() == [
        (0, SESSION_START_NS + 1310, 1, 0), (0, SESSION_START_NS + 2610, 1, 0), (0, SESSION_START_NS + 5310, 2, 0),
        (1, SESSION_START_NS + 1300, 1, 1), (1, SESSION_START_NS + 2600, 1, 1), (1, SESSION_START_NS + 5300, 2, 1)]
    assert _table(run / ".steplens", "flows").group_by("rank").len().sort("rank").rows() == [(0, 4), (1, 4)]
    assert not events.filter(pl.col("name") == "launch").height  # the launcher's range belongs to no rank
    issues = _table(run / ".steplens", "ingest_issues")
    assert sorted(issues.filter(pl.col("reason") == "rank_from_process")["rank"].to_list()) == [0, 1]
    # A re-run reuses both ranks' parts
    again = ingest(run, jobs=1)
    assert (again.parsed, again.reused) == (0, 2)
    assert {s["rank"]: s["unit"] for s in again.manifest["sources"]} == {0: f"process {PID + 100}", 1: f"process {PID}"}


def test_not_an_nsys_database_and_reports_are_listed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _build_export(run / "good.sqlite")
    other = sqlite3.connect(run / "mlflow.sqlite")
    other.execute("CREATE TABLE experiments (id INTEGER, name TEXT)")
    other.commit()
    other.close()
    (run / "alone.nsys-rep").write_bytes(b"\x00nsys report")
    (run / "good.nsys-rep").write_bytes(b"\x00nsys report")  # exported: good.sqlite is read instead
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    ingest(run, jobs=1)
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    by_path = {s["path"]: s for s in manifest["sources"]}
    assert by_path["good.sqlite"]["status"] == "ingested"
    assert by_path["mlflow.sqlite"]["status"] == "ignored"
    assert "not an Nsight Systems export (its tables: experiments)" in by_path["mlflow.sqlite"]["issues"][0][3]
    report = by_path["alone.nsys-rep"]
    assert report["status"] == "ignored"
    assert f"nsys export --type sqlite --output {run / 'alone.sqlite'} {run / 'alone.nsys-rep'}" in report["issues"][0][3]
    assert "good.nsys-rep" in manifest["ignored_files"]
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name != ".steplens"} == before  # inputs untouched


def test_nsys_export_flag_without_nsys_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    run = tmp_path / "run"
    run.mkdir()
    _build_export(run / "a.sqlite")
    (run / "b.nsys-rep").write_bytes(b"\x00")
    result = CliRunner().invoke(analyze, [str(run), "-q", "--jobs", "1", "--ingest-only", "--nsys-export"])
    assert "b.nsys-rep: nsys is not on the PATH: not exported" in " ".join(result.output.split())
    assert not (run / "b.sqlite").exists()


def test_nsys_export_flag_runs_the_export_command(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nsys"  # stands in for nsys: records its arguments and writes the export it was asked for
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'args'}\ncp {tmp_path / 'made.sqlite'} \"$5\"\n")
    fake.chmod(0o755)
    _build_export(tmp_path / "made.sqlite")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    run = tmp_path / "run"
    run.mkdir()
    (run / "r.nsys-rep").write_bytes(b"\x00")
    result = CliRunner().invoke(analyze, [str(run), "-q", "--jobs", "1", "--ingest-only", "--nsys-export"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "args").read_text().split() == ["export", "--type", "sqlite", "--output", str(run / "r.sqlite"),
                                                       str(run / "r.nsys-rep")]
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    assert {s["path"]: s["status"] for s in manifest["sources"]} == {"r.sqlite": "ingested"}


def test_an_nsys_export_that_hangs_is_stopped_with_what_it_started(tmp_path, monkeypatch):
    """`nsys export` ran without a time limit, and what it started outlived analyze; past the limit its whole process
    group is stopped and the report named as not exported."""
    import os
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pid_file = tmp_path / "child.pid"
    fake = bin_dir / "nsys"  # hangs, with a child of its own
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(nsys, "EXPORT_TIMEOUT_S", 2)
    run = tmp_path / "run"
    run.mkdir()
    (run / "r.nsys-rep").write_bytes(b"\x00")
    started = time.monotonic()
    [(report, outcome)] = nsys.export_reports(run)
    assert time.monotonic() - started < 30 and report == run / "r.nsys-rep"
    assert outcome == "nsys export did not finish in 2 s: stopped, not exported"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{child}") and \
            "zombie" not in open(f"/proc/{child}/status").read():
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}") or "zombie" in open(f"/proc/{child}/status").read()


def test_export_trace_writes_an_nsys_run_for_perfetto(tmp_path):
    from steplens.analyze.cli import steplens

    run = tmp_path / "run"
    run.mkdir()
    _build_export(run / "report_rank0.sqlite")
    assert CliRunner().invoke(analyze, [str(run), "-q", "--jobs", "1"]).exit_code == 0
    out = tmp_path / "merged.json"
    result = CliRunner().invoke(steplens, ["export-trace", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    kernels = sorted((e["ts"], e["dur"]) for e in events if e.get("cat") == "kernel")
    # ts in µs from the first exported event (the step range at 1000 ns), as the export writes them
    assert kernels == [(0.3, 1.0), (1.6, 2.0), (4.3, 1.0)]
    starts = sorted(e["ts"] for e in events if e.get("ph") == "s")
    assert starts == [0.1, 1.45, 4.1, 5.5]  # the four launch calls, linked to their device work


def test_a_cluster_parse_of_several_processes_gives_the_local_tables(tmp_path):
    import os
    import subprocess
    import sys

    distributed = pytest.importorskip("distributed")
    run = tmp_path / "run"
    run.mkdir()
    _build_export(run / "node0.sqlite", second_process=True)

    def analyze_to(out: Path, *extra: str) -> None:
        done = subprocess.run([sys.executable, "-m", "steplens.analyze", str(run), "--out", str(out), "-q", "--ingest-only",
                               *extra], capture_output=True, text=True, timeout=300, env=dict(os.environ))
        assert done.returncode == 0, done.stderr

    def tables(out: Path) -> dict[int, pl.DataFrame]:
        events = _table(out, "trace_events").drop("source")
        return {rank: events.filter(pl.col("rank") == rank).sort("event_id") for rank in (0, 1)}

    analyze_to(tmp_path / "single", "-j", "1")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as local:
        analyze_to(tmp_path / "clustered", "--scheduler", local.scheduler_address)
    single, clustered = tables(tmp_path / "single"), tables(tmp_path / "clustered")
    # per process: 3 kernels, 5 API calls, a memcpy, a sync, 2 step ranges, the NCCL range and a mark
    assert all(single[rank].height == 14 and single[rank].equals(clustered[rank]) for rank in (0, 1))


def test_values_of_the_wrong_type_and_damaged_files_are_counted_not_fatal(tmp_path):
    export = _build_export(tmp_path / "a.sqlite")
    db = sqlite3.connect(export)
    db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = 'soon' WHERE correlationId = 1")
    db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = 6300.5 WHERE correlationId = 3")
    db.commit()
    db.close()
    parsed = read_trace(export, "a")
    issues = {i.reason: i for i in parsed.issues}
    assert issues["unrepresentable_value"].count == 2
    assert "CUPTI_ACTIVITY_KIND_KERNEL.start (1)" in issues["unrepresentable_value"].detail
    assert issues["bad_timestamp"].count == 1 and issues["missing_duration"].count == 1
    kernels = parsed.events.filter(pl.col("kind") == "kernel").sort("ts_ns")
    assert kernels.select("ts_ns", "dur_ns").rows() == [(SESSION_START_NS + 2600, 2000), (SESSION_START_NS + 5300, None)]
    # A file cut short is a damaged input, named, not a traceback
    run = tmp_path / "run"
    run.mkdir()
    data = DLPROF.read_bytes()
    (run / "cut.sqlite").write_bytes(data[: len(data) // 3])
    _build_export(run / "good.sqlite")
    ingest(run, jobs=1)
    manifest = json.loads((run / ".steplens" / "run.json").read_text())
    by_path = {s["path"]: s for s in manifest["sources"]}
    assert by_path["good.sqlite"]["status"] == "ingested"
    assert by_path["cut.sqlite"]["status"] == "error"
    assert by_path["cut.sqlite"]["issues"][0][1] == "damaged_trace"


def test_times_that_would_wrap_int64_are_damage_not_times(tmp_path):
    """A kernel's start or end near the int64 limits wrapped to ts_ns -7.5e18 and dur_ns -9.2e18 without a word once
    the session start was added; such a start drops its row, such an end leaves the duration null, both counted."""
    export = _build_export(tmp_path / "a.sqlite")
    db = sqlite3.connect(export)
    db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET start = ? WHERE correlationId = 1", (2**63 - 10,))
    db.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET end = ? WHERE correlationId = 3", (2**63 - 1,))
    db.commit()
    db.close()
    rows = _sql(export, "SELECT start, end FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE correlationId NOT IN (1, 3) ORDER BY start")
    parsed = read_trace(export, "a")
    issues = {i.reason: i for i in parsed.issues}
    assert issues["bad_timestamp"].count == 1 and issues["missing_duration"].count == 1
    kernels = parsed.events.filter(pl.col("kind") == "kernel").sort("ts_ns")
    untouched = kernels.filter(pl.col("dur_ns").is_not_null()).select("ts_ns", "dur_ns").rows()
    assert untouched == [(SESSION_START_NS + start, end - start) for start, end in rows]
    assert kernels.filter(pl.col("dur_ns").is_null()).height == 1
    assert (kernels["ts_ns"] > 0).all()


def test_an_empty_export_is_named_and_a_table_of_any_name_is_read_around(tmp_path):
    """A 0-byte .sqlite was ignored as a file in no known format; a table named with a double quote (written by a
    tool beside nsys) made the whole export unreadable."""
    run = tmp_path / "run"
    run.mkdir()
    export = _build_export(run / "rank0.sqlite")
    db = sqlite3.connect(export)
    db.execute('CREATE TABLE "my ""notes"" table" (x INTEGER)')
    db.commit()
    db.close()
    (run / "rank1.sqlite").write_bytes(b"")
    ingest(run, jobs=1)
    by_path = {s["path"]: s for s in json.loads((run / ".steplens" / "run.json").read_text())["sources"]}
    assert by_path["rank0.sqlite"]["status"] == "ingested"
    assert by_path["rank1.sqlite"]["status"] == "error" and by_path["rank1.sqlite"]["issues"][0][1] == "empty_file"
    kernels = _table(run / ".steplens", "trace_events").filter(pl.col("kind") == "kernel")
    assert kernels.height == _sql(export, "SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL")[0][0]


# The columns the importer reads whose absence loses something (names have alternatives across versions).
READ_COLUMNS = {
    "CUPTI_ACTIVITY_KIND_KERNEL": ("start", "end", "deviceId", "streamId", "correlationId", "globalPid"),
    "CUPTI_ACTIVITY_KIND_RUNTIME": ("start", "end", "globalTid", "correlationId", "nameId", "eventClass"),
    "CUPTI_ACTIVITY_KIND_MEMCPY": ("start", "end", "deviceId", "streamId", "correlationId", "globalPid", "bytes", "copyKind"),
    "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION": ("start", "end", "deviceId", "streamId", "correlationId", "globalPid", "syncType"),
    "NVTX_EVENTS": ("start", "end", "eventType", "globalTid", "domainId", "category", "jsonText", "jsonTextId"),
    "StringIds": ("value",),
}


def test_any_column_or_table_missing_is_read_around(tmp_path):
    """Exports of other nsys versions lack tables and columns: each one dropped in turn gives a trace
    (or, without any event, an empty one) and counted gaps, never an exception."""
    built = _build_export(tmp_path / "full.sqlite", env={"RANK": "0"})
    tables = {name: [row[1] for row in _sql(built, f'PRAGMA table_info("{name}")') if not row[5]]  # SQLite keeps keys
              for (name,) in _sql(built, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    cases = [(table, None) for table in tables] + [(table, column) for table, columns in tables.items() for column in columns]
    for i, (table, column) in enumerate(cases):
        variant = tmp_path / f"v{i}.sqlite"
        variant.write_bytes(built.read_bytes())
        db = sqlite3.connect(variant)
        db.execute(f'DROP TABLE "{table}"' if column is None else f'ALTER TABLE "{table}" DROP COLUMN "{column}"')
        db.commit()
        db.close()
        parsed = read_trace(variant, "v")
        gaps = [i.detail for i in parsed.issues if i.reason == "nsys_schema_gap"]
        if column in READ_COLUMNS.get(table, ()):
            assert any(f"{table} without {column}" in detail for detail in gaps), (table, column)
        elif column is not None:  # one of alternative name columns, or one not read: no gap to tell
            assert not any(table in detail for detail in gaps), (table, column, gaps)
        assert parsed.events["ts_ns"].is_not_null().all(), (table, column)


def test_each_process_counts_its_own_rows_problems(tmp_path):
    """Two processes, one range left open in each: every rank was given the file's count (2 and 2, 4 in all for 2
    open ranges). Each rank now counts its own (1 and 1); the file's own problems go with one rank only."""
    run = tmp_path / "run"
    run.mkdir()
    export = _build_export(run / "node0.sqlite", second_process=True)
    db = sqlite3.connect(export)
    for pid in (PID, PID + 100):
        db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (9500, NULL, 59, 'open', ?)",
                   (_global_id(pid, pid + 1),))
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (0, 99999, 59, 'launch', ?)",
               (_global_id(99, 99),))  # a launcher's range: the file's, belonging to no rank
    db.commit()
    db.close()
    ingest(run, jobs=1)
    issues = _table(run / ".steplens", "ingest_issues")
    open_ranges = issues.filter(pl.col("reason") == "missing_duration").sort("rank").select("rank", "count").rows()
    assert open_ranges == [(0, 1), (1, 1)]
    assert issues.filter(pl.col("reason") == "several_processes")["count"].to_list() == [1]


def test_a_trace_whose_every_row_is_left_out_says_why(tmp_path):
    """Every start beyond 146 years of the session start: 'a trace with no complete events (empty or cut before the
    first event)' named neither the problem nor its count."""
    run = tmp_path / "run"
    run.mkdir()
    export = _build_export(run / "a.sqlite")
    db = sqlite3.connect(export)
    rows = 0
    for table in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_MEMCPY",
                  "CUPTI_ACTIVITY_KIND_SYNCHRONIZATION", "NVTX_EVENTS"):
        rows += db.execute(f"UPDATE {table} SET start = start + ?", (2**62,)).rowcount
    rows -= db.execute("SELECT count(*) FROM NVTX_EVENTS WHERE eventType = 75").fetchone()[0]  # domain names: no events
    db.commit()
    db.close()
    from steplens.analyze.pipeline.ingest import IngestError

    with pytest.raises(IngestError) as refused:
        ingest(run, jobs=1)
    assert (f"nothing usable among 1 file(s) (a.sqlite: a trace with no events left once rows with problems were "
            f"left out: bad_timestamp ({rows:,}))") in str(refused.value)


def test_the_processes_of_one_export_share_its_clock(tmp_path):
    """Two processes of one export (one host's clock) were aligned by their collectives' end times: the second
    one, whose work runs 10 ns later, was moved by an offset of 10 ns as if its clock were another's."""
    run = tmp_path / "run"
    run.mkdir()
    _build_export(run / "node0.sqlite", second_process=True)
    result = CliRunner().invoke(analyze, [str(run), "-q"])
    assert result.exit_code == 0, result.output
    offsets = _table(run / ".steplens", "clock_offsets").sort("rank")
    assert offsets.select("rank", "offset_ns", "uncertainty_ns").rows() == [(0, 0, 0), (1, 0, 0)]
    assert offsets["method"].to_list() == ["reference", "one clock with the reference rank (same file)"]


def test_ranks_of_another_file_get_one_offset():
    """Two hosts' exports: the second host's ranks share its clock, one offset for both (their estimates' median)."""
    from steplens.analyze.analyses import steps

    calls = pl.DataFrame({"rank": [0, 1, 2, 3] * 2, "instance": [0] * 4 + [1] * 4,
                          "ts_ns": [1_000, 1_000, 1_100, 1_120, 5_000, 5_000, 5_100, 5_120], "dur_ns": [10] * 8})
    files = {0: "node0.sqlite", 1: "node0.sqlite", 2: "node1.sqlite", 3: "node1.sqlite"}
    offsets = steps.clock_offsets(calls, [0, 1, 2, 3], files=files).sort("rank")
    assert offsets["offset_ns"].to_list() == [0, 0, 110, 110]
    alone = steps.clock_offsets(calls, [0, 1, 2, 3]).sort("rank")
    assert alone["offset_ns"].to_list() == [0, 0, 100, 120]


@pytest.mark.parametrize("damage, count", [("DROP TABLE CUPTI_ACTIVITY_KIND_KERNEL", 3),  # 3 kernel launch calls
                                           ("ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL DROP COLUMN streamId", 3)])  # 3 kernels
def test_an_export_that_lost_its_kernels_or_their_streams_says_data_was_lost(tmp_path, damage, count):
    """The kernel table gone while the launches remain, or the kernels' streamId gone: the verdict read 'idle 98%'
    off the copies alone with exit 0 and an info-level schema gap. Now an error (events_lost): numbers cover what was
    readable, exit 1."""
    (tmp_path / "run").mkdir()
    path = _build_export(tmp_path / "run" / "a.sqlite")
    db = sqlite3.connect(path)
    db.execute(damage)
    db.commit()
    db.close()
    parsed = read_trace(path, "a.sqlite")
    assert [(i.severity, i.count) for i in parsed.issues if i.reason == "events_lost"] == [("error", count)]
    result = CliRunner().invoke(analyze, [str(tmp_path / "run"), "-q"])
    assert result.exit_code == 1 and "lost data" in result.output
    intact = read_trace(_build_export(tmp_path / "intact.sqlite"), "intact.sqlite")
    assert not [i for i in intact.issues if i.reason == "events_lost"]
