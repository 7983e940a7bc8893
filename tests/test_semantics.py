"""Trace semantics on tables built by hand (no trace file, no importer): steps, step of each event,
launch and flow links, and what is counted when they do not hold together."""

import polars as pl

from steplens.analyze.trace import semantics

EVENT_SCHEMA = {"event_id": pl.Int64, "ts_ns": pl.Int64, "dur_ns": pl.Int64, "kind": pl.String, "name": pl.String,
                "pid": pl.Int64, "tid": pl.Int64, "correlation": pl.Int64}
ENDPOINT_SCHEMA = {"ph": pl.String, "cat": pl.String, "pid": pl.Int64, "tid": pl.Int64, "ts_ns": pl.Int64,
                   "flow_id": pl.Int64}


def _events(rows):
    """rows: (ts_ns, dur_ns, kind, name, pid, tid, correlation), in time order; event_id = position."""
    return pl.DataFrame([(i, *r) for i, r in enumerate(rows)], schema=EVENT_SCHEMA, orient="row")


def _endpoints(rows=()):
    return pl.DataFrame(list(rows), schema=ENDPOINT_SCHEMA, orient="row")


# Two steps on the host thread (pid 1, tid 1); kernels on stream 7 of device 0.
ROWS = [
    (1_000, 1_000, "user_annotation", "ProfilerStep#4", 1, 1, None),   # 0: step 4 = [1000, 2000)
    (1_100, 50, "cuda_runtime", "cudaLaunchKernel", 1, 1, 10),         # 1
    (1_900, 50, "cuda_runtime", "cudaStreamSynchronize", 1, 1, 11),   # 2
    (2_000, 1_000, "user_annotation", "ProfilerStep#5", 1, 1, None),   # 3: step 5 = [2000, 3000)
    (2_100, 300, "kernel", "k_late", 0, 7, 10),                       # 4: runs in step 5's window, launched in step 4
    (2_200, 50, "cuda_runtime", "cudaGraphLaunch", 1, 1, 12),         # 5
    (2_500, 10, "kernel", "g0", 0, 7, 12),                            # 6
    (2_600, 10, "kernel", "g1", 0, 7, 12),                            # 7
    (2_700, 10, "gpu_memcpy", "orphan_copy", 0, 7, 99),               # 8: its launch is not in the trace
    (3_500, 5, "cpu_op", "aten::after", 1, 1, None),                  # 9: after the last step
]


def test_steps_and_step_of_each_event():
    issues = []
    events, steps, _ = semantics.apply(_events(ROWS), _endpoints(), issues)
    assert steps.select("step", "start_ns", "end_ns", "dur_ns").rows() == [(4, 1_000, 2_000, 1_000), (5, 2_000, 3_000, 1_000)]
    by_name = dict(events.select("name", "step").rows())
    assert by_name["cudaLaunchKernel"] == 4 and by_name["cudaGraphLaunch"] == 5
    assert by_name["k_late"] == 4  # the step of its launch, not of the window it ran in
    assert by_name["g0"] == by_name["g1"] == 5
    assert by_name["orphan_copy"] is None  # no launch: no step, rather than a guess by time
    assert by_name["aten::after"] is None


def test_launch_links_graph_launch_and_orphans():
    issues = []
    events, _, flows = semantics.apply(_events(ROWS), _endpoints(), issues)
    assert flows.select("src_event_id", "dst_event_id", "via").rows() == [
        (1, 4, "correlation"), (5, 6, "correlation"), (5, 7, "correlation")]
    assert dict(events.select("name", "launch_event_id").rows())["g1"] == 5
    assert events.filter(pl.col("is_launch"))["name"].to_list() == ["cudaLaunchKernel", "cudaGraphLaunch"]
    orphans = [i for i in issues if i.reason == "orphan_device_activity"]
    assert len(orphans) == 1 and orphans[0].count == 1 and "10 ns of GPU time" in orphans[0].detail


def test_repeated_correlation_links_the_launch_call():
    rows = [(100, 10, "cuda_runtime", "cudaEventQuery", 1, 1, 5),
            (120, 10, "cuda_runtime", "cudaLaunchKernel", 1, 1, 5),
            (200, 10, "kernel", "k", 0, 7, 5)]
    _, _, flows = semantics.apply(_events(rows), _endpoints(), [])
    assert flows.select("src_event_id", "dst_event_id").rows() == [(1, 2)]


def test_flow_events_add_only_links_correlation_cannot_see():
    rows = [(100, 50, "cpu_op", "aten::mm", 1, 1, None),            # 0
            (110, 10, "cuda_runtime", "cudaLaunchKernel", 1, 1, 7),  # 1
            (200, 30, "kernel", "k", 0, 7, 7),                      # 2
            (300, 40, "cpu_op", "autograd::mm_backward", 1, 2, None)]  # 3
    endpoints = [("s", "ac2g", 1, 1, 110, 7), ("f", "ac2g", 0, 7, 200, 7),  # agrees with correlation
                 ("s", "fwdbwd", 1, 1, 100, 1), ("f", "fwdbwd", 1, 2, 300, 1),  # forward -> backward
                 ("s", "ac2g", 1, 1, 110, 8)]  # no end in the trace
    issues = []
    _, _, flows = semantics.apply(_events(rows), _endpoints(endpoints), issues)
    assert flows.select("flow_type", "src_event_id", "dst_event_id", "via").rows() == [
        ("fwdbwd", 0, 3, "flow_event"), ("launch", 1, 2, "correlation")]
    assert [(i.reason, i.count) for i in issues] == [("flow_without_end", 1)]


def test_damaged_step_number_is_a_plain_event():
    rows = [(100, 10, "user_annotation", "ProfilerStep#99999999999", 1, 1, None),
            (200, 10, "user_annotation", "ProfilerStep#3", 1, 1, None)]
    issues = []
    _, steps, _ = semantics.apply(_events(rows), _endpoints(), issues)
    assert steps["step"].to_list() == [3]
    assert [(i.reason, i.count) for i in issues] == [("bad_step_number", 1)]


def test_ranges_of_one_step_nested_on_a_thread_are_one_step_row_per_thread():
    """An NVTX 'iteration 3' holding 'step 3' on one thread gave two rows of step 3 (a query over `steps` counted
    it twice); the step on another thread keeps its own row, as ProfilerStep on several threads does."""
    import re

    from steplens.analyze.importers.nsys import DEFAULT_STEP_RANGE

    rows = [(1_000, 1_000, "user_annotation", "iteration 3", 1, 1, None),
            (1_010, 980, "user_annotation", "step 3", 1, 1, None),
            (1_005, 990, "user_annotation", "step 3", 1, 2, None),
            (2_000, 1_000, "user_annotation", "iteration 4", 1, 1, None),
            (2_010, 980, "user_annotation", "step 4", 1, 1, None)]
    issues = []
    _, steps, _ = semantics.apply(_events(rows), _endpoints(), issues, step_name=re.compile(DEFAULT_STEP_RANGE))
    assert steps.select("step", "start_ns", "end_ns", "dur_ns", "tid").rows() == [
        (3, 1_000, 2_000, 1_000, 1), (3, 1_005, 1_995, 990, 2), (4, 2_000, 3_000, 1_000, 1)]
    assert issues == []
