"""Cross-checks with Holistic Trace Analysis (HTA 0.5.0) on real traces.

HTA's outputs were produced once by tests/benchmarks/hta_fixtures.py and stored in tests/fixtures/hta/
(see its README for HTA's definitions, with source lines). Where the definitions match, steplens must
agree within HTA's rounding (it snaps starts up and ends down to whole µs: up to 2 µs per value);
where HTA is wrong, steplens must not repeat the error.
"""

from pathlib import Path

import polars as pl
import pytest

from steplens.analyze.pipeline import analyse

from conftest import CORPUS

FIXTURES = Path(__file__).parent / "fixtures" / "hta"
TRACES = {
    "nccl_a100": "HolisticTraceAnalysis/nccl_parser_config",
    "ns_resolution_v100": "HolisticTraceAnalysis/ns_resolution_trace",
    "triton_example": "HolisticTraceAnalysis/triton_example",
    "h100_qwen": "TraceLens/h100/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
    "mi300_qwen": "TraceLens/mi300/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
    "sglang_decode": "TraceLens/inference_sglang_decode/sglang_Qwen3-8B_decode.json.gz",
    "dlrm_8rank": "param/dlrm_kineto",
}
HTA_ROUNDING_NS = 2000

pytestmark = pytest.mark.skipif(not CORPUS.is_dir(), reason="shared corpus not found")


@pytest.fixture(scope="module")
def analysed(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            path = CORPUS / TRACES[name]
            out = tmp_path_factory.mktemp(name) / "out"
            files = [path] if path.is_file() else None
            folder = path.parent if path.is_file() else path
            findings = {}
            findings.update(analyse(folder, out, jobs=1, files=files)[1])
            cache[name] = (out, findings)
        return cache[name]

    return get


def _table(out, name):
    return pl.read_parquet(out / name / "*.parquet")


@pytest.mark.parametrize("name,hta_file", [
    ("nccl_a100", "cuda_kernel_launch_stats_rank0.csv"),
    ("ns_resolution_v100", "cuda_kernel_launch_stats_rank0.csv.gz"),
    ("h100_qwen", "cuda_kernel_launch_stats_rank0.csv"),
    *[("dlrm_8rank", f"cuda_kernel_launch_stats_allranks_rank{r}.csv") for r in range(8)],
])
def test_launch_stats_agree_with_hta_where_definitions_match(analysed, name, hta_file):
    out, _ = analysed(name)
    rank = int(hta_file.rsplit("rank", 1)[1].split(".")[0])
    hta = pl.read_csv(FIXTURES / name / hta_file)
    mine = _table(out, "kernel_launches").filter((pl.col("rank") == rank) & pl.col("launch_api").is_not_null())
    joined = hta.join(mine, on="correlation", how="left")
    assert joined["api_ns"].null_count() == 0  # every launch HTA saw, steplens saw
    # HTA: cpu_duration, gpu_duration in µs; launch_delay = gpu.ts - (cpu.ts + cpu.dur), clipped at 0.
    assert (joined["api_ns"] - joined["cpu_duration"] * 1000).abs().max() <= HTA_ROUNDING_NS
    assert (joined["dur_ns"] - joined["gpu_duration"] * 1000).abs().max() <= HTA_ROUNDING_NS
    delay = joined["queue_ns"].clip(lower_bound=0)
    assert (delay - joined["launch_delay"] * 1000).abs().max() <= 2 * HTA_ROUNDING_NS
    assert mine.height >= hta.height


@pytest.mark.parametrize("rank", range(8))
def test_host_wait_agrees_with_hta_on_dlrm(analysed, rank):
    """HTA's host_wait (a gap whose next launch started after the previous activity ended) is the
    same rule as steplens' host-bound + sync, but over the whole trace instead of step spans."""
    out, _ = analysed("dlrm_8rank")
    hta = pl.read_csv(FIXTURES / "dlrm_8rank" / "idle_time_breakdown_allranks_0.csv").filter(
        (pl.col("rank") == rank) & (pl.col("idle_category") == "host_wait"))
    launches = _table(out, "kernel_launches").filter(pl.col("rank") == rank).sort("stream", "ts_ns")
    gaps = launches.with_columns(prev_end=(pl.col("ts_ns") + pl.col("dur_ns")).cum_max().shift(1).over("stream")).filter(
        (pl.col("ts_ns") > pl.col("prev_end")) & (pl.col("launch_ts_ns") >= pl.col("prev_end")))
    mine = dict(gaps.group_by("stream").agg((pl.col("ts_ns") - pl.col("prev_end")).sum()).iter_rows())
    for stream, hta_us, in hta.select("stream", "idle_time").iter_rows():
        gap_count = gaps.filter(pl.col("stream") == stream).height
        assert mine.get(stream, 0) == pytest.approx(hta_us * 1000, abs=HTA_ROUNDING_NS * gap_count + 1000), stream


def test_hip_and_graph_launches_are_counted(analysed):
    """HTA's launch statistics cover 0 of 1517 MI300X kernels (hip* launches) and 0 of 558 SGLang
    kernels (hipGraphLaunch); steplens links every kernel that has a launch event in the trace."""
    for name, apis in (("mi300_qwen", {"hipLaunchKernel", "hipExtModuleLaunchKernel", "hipModuleLaunchKernel"}),
                       ("sglang_decode", {"hipGraphLaunch"})):
        out, _ = analysed(name)
        assert len(pl.read_csv(FIXTURES / name / "cuda_kernel_launch_stats_rank0.csv")) == 0
        launches = _table(out, "kernel_launches").filter(pl.col("kind") == "kernel")
        linked = launches.filter(pl.col("launch_api").is_not_null())
        assert apis <= set(linked["launch_api"])
        assert linked.height > 0.5 * launches.height
    out, _ = analysed("sglang_decode")
    graph = _table(out, "kernel_launches").filter(pl.col("launch_api") == "hipGraphLaunch")
    assert graph.height == 544 and graph["correlation"].n_unique() < 10  # one launch, many kernels


def test_cpu_op_with_stream_arg_is_not_gpu_time(analysed):
    """HTA's temporal breakdown reports 94 µs of kernel time for triton_example: a CPU launcher op
    carrying a `stream` arg. The only kernel ran 1.76 µs."""
    hta = pl.read_csv(FIXTURES / "triton_example" / "temporal_breakdown.csv")
    assert hta["kernel_time(us)"][0] == 94.0
    out, _ = analysed("triton_example")
    busy = _table(out, "gpu_idle").filter((pl.col("stream") == -1) & pl.col("step").is_null())["busy_ns"].sum()
    work = _table(out, "kernel_launches")
    assert work.height == 1 and busy == work["dur_ns"][0] < 2000


def test_no_communication_is_said_not_nan(analysed):
    hta = pl.read_csv(FIXTURES / "mi300_qwen" / "comm_comp_overlap.csv")
    assert hta["comp_comm_overlap_pctg"].null_count() == 1  # HTA: NaN
    _, findings = analysed("mi300_qwen")
    collectives = findings["collectives"]
    assert collectives["most_exposed_collective"] is None and collectives["comms_note"] == "no collectives in the traces"


def test_no_gpu_op_is_dropped(analysed):
    """HTA keeps 2516 of nccl_a100's 3774 GPU events (it drops everything from the last
    ProfilerStep on) and rounds the rest to whole µs, losing 2.27% of GPU time."""
    out, _ = analysed("nccl_a100")
    hta = pl.read_csv(FIXTURES / "nccl_a100" / "cuda_kernel_launch_stats_rank0.csv")
    assert len(hta) == 2516
    work = _table(out, "kernel_launches")
    assert work.height == 2700 + 960 + 114  # kernels + memcpy + memset in the file
    events = pl.scan_parquet(out / "trace_events").filter(pl.col("kind").is_in(["kernel", "gpu_memcpy", "gpu_memset"])).collect()
    assert work["dur_ns"].sum() == events["dur_ns"].sum()
    rounded = ((events["ts_ns"] + events["dur_ns"]) // 1000 - (events["ts_ns"] + 999) // 1000).sum() * 1000
    assert rounded < 0.99 * work["dur_ns"].sum()  # what HTA's snapping would have reported


def test_idle_share_is_not_inflated_by_rounding(analysed):
    """Exact ns keep short gaps short: the device-level idle share of a run equals what the exact
    intervals give, with no µs snapping."""
    out, _ = analysed("h100_qwen")
    idle = _table(out, "gpu_idle").filter(pl.col("stream") == -1)
    assert (idle["busy_ns"] + idle["idle_ns"] == idle["span_ns"]).all()
    assert (idle["idle_ns"] >= 0).all()
