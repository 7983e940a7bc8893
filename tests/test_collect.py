"""The in-job collector on real DeepSpeed jobs (CPU, 2 ranks, gloo), read back through `analyze`.

The jobs run once per session (tests/realrun/train_tiny_gpt.py, about 25 s each on 2 cores):
  z1_gas2_fault  ZeRO-1, 2 micro steps per step, a fault injected into the timer hook
  z2             ZeRO-2: comms logger verbose, unknown comm ops, a comms probe, FLOPs, a profiler window;
                 DeepSpeed's csv_monitor, TensorBoard and W&B (offline) monitors on
  z3             ZeRO-3 with a FLOPs profile (the double-counting flag)
  killed         ZeRO-2, rank 1 SIGKILLs itself after step 4, flushes every 2 steps
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from steplens.analyze.importers import collector_parts
from steplens.analyze.pipeline import ingest
from steplens.analyze.contract import schema
from steplens.collect import Settings

sys.path.insert(0, str(Path(__file__).parent / "realrun"))

STEPS = 6
MICRO_BATCH = 4  # train_tiny_gpt.py default
SEQ_LEN = 64  # train_tiny_gpt.py default
RANKS = 2
KILLED_RANK, KILL_AT_STEP, KILL_STEPS = 1, 4, 8
PROBE_STEP = 3
PROFILE = {"skip_first": 2, "wait": 1, "warmup": 1, "active": 1, "repeat": 1}  # train_tiny_gpt.py defaults
JOBS = {
    "z1_gas2_fault": ("--zero_stage", "1", "--gas", "2", "--steps", "4", "--wall_clock_breakdown",
                      "--inject_fault", "record_timers", "--profile_window", "off", "--flops_step", "-1"),
    "z2": ("--zero_stage", "2", "--steps", str(STEPS), "--wall_clock_breakdown", "--csv_monitor", "--tensorboard", "--wandb",
           "--comms_logger", "verbose", "--log_level", "info", "--unknown_comm_op", "--probe_comms", str(PROBE_STEP),
           "--flush_every", "2"),
    "z3": ("--zero_stage", "3", "--steps", "4", "--flops_step", "1", "--profile_window", "off"),
    "killed": ("--zero_stage", "2", "--steps", str(KILL_STEPS), "--flush_every", "2", "--kill_rank", str(KILLED_RANK),
               "--kill_at_step", str(KILL_AT_STEP), "--profile_window", "off", "--flops_step", "-1"),
}


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("torch")
    pytest.importorskip("deepspeed")
    from launch import run_tiny_gpt

    if reuse := os.environ.get("STEPLENS_COLLECT_RUNS"):  # a folder of runs made before: iterate on the tests faster
        root = Path(reuse)
        if all((root / name / "script").exists() or name == "killed" for name in JOBS):
            for name in JOBS:
                shutil.rmtree(root / name / ".steplens", ignore_errors=True)
            return {name: root / name for name in JOBS}
    else:
        root = tmp_path_factory.mktemp("collector_runs")
    return {name: run_tiny_gpt(root / name, *args, check=name != "killed") for name, args in JOBS.items()}


@pytest.fixture(scope="session")
def ingested(runs) -> dict[str, ingest.IngestResult]:
    return {name: ingest.ingest(path, jobs=1) for name, path in runs.items()}


def table(result: ingest.IngestResult, name: str, collector_only: bool = True) -> pl.DataFrame:
    frame = pl.read_parquet(result.out_dir / name)
    return frame.filter(pl.col("source").str.starts_with("collector/")) if collector_only else frame


def issues(result: ingest.IngestResult) -> pl.DataFrame:
    return pl.read_parquet(result.out_dir / "ingest_issues")


def script_record(run: Path, rank: int) -> dict:
    return json.loads((run / "script" / f"rank{rank}.json").read_text())


# --- a finished job: analyze reads all of it ------------------------------------------------------------


@pytest.mark.parametrize("name", ["z1_gas2_fault", "z2", "z3"])
def test_analyze_reads_every_collector_file(ingested, runs, name):
    result = ingested[name]
    # every file but the ranks' hidden locks (collector/manifest/.rank<r>.lock, held while the job ran)
    collector_files = sorted(str(p.relative_to(runs[name])) for p in (runs[name] / "collector").rglob("*")
                             if p.is_file() and not p.name.startswith("."))
    assert {p.name for p in (runs[name] / "collector" / "manifest").glob(".*")} == {".rank0.lock", ".rank1.lock"}
    sources = {s.path: s for s in result.sources}
    assert collector_files and all(sources[f].kind == "collector" and sources[f].status == "ingested"
                                   for f in collector_files)
    ours = issues(result).filter(pl.col("file").str.starts_with("collector/") | pl.col("file").str.starts_with("traces/"))
    assert ours.filter(pl.col("severity") == "error").is_empty()
    facts = result.manifest["facts"]
    config = json.loads((runs[name] / "ds_config.json").read_text())
    assert facts["ds_config"] == config
    assert facts["zero_stage"] == config["zero_optimization"]["stage"]
    assert facts["world_size"] == RANKS and facts["dtype"] == "fp32" and facts["seq_len"] == SEQ_LEN
    assert facts["micro_batch"] == MICRO_BATCH and facts["grad_accum"] == config["gradient_accumulation_steps"]
    assert facts["train_batch_size"] == MICRO_BATCH * config["gradient_accumulation_steps"] * RANKS
    import deepspeed
    import torch

    assert facts["environment"]["torch"] == torch.__version__ and facts["environment"]["deepspeed"] == deepspeed.__version__
    # The training script's revision: HEAD when the job ran (others may have committed since).
    subprocess.run(["git", "merge-base", "--is-ancestor", facts["git"]["commit"], "HEAD"], check=True,
                   cwd=Path(__file__).parent)
    for rank in range(RANKS):
        assert facts[f"collector_rank{rank}"]["status"] == "completed"
    status = table(result, "run_status")
    assert sorted(status["rank"].to_list()) == [0, 1] and set(status["status"]) == {"completed"}


def test_one_row_per_micro_step_with_the_engines_global_samples(ingested, runs):
    """z1 runs 2 micro steps per optimizer step: the samples count up by one micro batch per rank in
    between, and reach the engine's global_samples (recorded by the script) at each boundary."""
    gas, steps = 2, 4
    rows = table(ingested["z1_gas2_fault"], "train_steps").sort("rank", "micro_step")
    for rank in range(RANKS):
        mine = rows.filter(pl.col("rank") == rank)
        assert mine["micro_step"].to_list() == list(range(steps * gas))
        assert mine["step"].to_list() == [m // gas for m in range(steps * gas)]
        assert mine["is_boundary"].to_list() == [m % gas == gas - 1 for m in range(steps * gas)]
        engine = [s["global_samples"] for s in script_record(runs["z1_gas2_fault"], rank)["steps"]]
        assert mine.filter("is_boundary")["global_samples"].to_list() == engine
        between = mine.filter(~pl.col("is_boundary"))["global_samples"].to_list()
        assert between == [e - MICRO_BATCH * RANKS for e in engine]
        assert (mine["global_tokens"] == mine["global_samples"] * SEQ_LEN).all()
        assert (mine["dur_ns"] > 0).all() and (mine["start_ns"].diff().drop_nulls() > 0).all()


def test_scalars_carry_the_engines_global_samples(ingested, runs):
    result = ingested["z2"]
    scalars = table(result, "scalars")
    engine = {s["step"]: s["global_samples"] for s in script_record(runs["z2"], 0)["steps"]}
    for name in ("Train/Samples/lr", "Train/Samples/elapsed_time_ms_forward", "train/loss"):
        points = scalars.filter(pl.col("name") == name).sort("step")
        assert dict(zip(points["step"], points["global_samples"])) == engine, name
    assert set(scalars["rank"]) == {0}  # rank 0 by default
    # The collector and csv_monitor saw the same DeepSpeed events.
    csv = table(result, "scalars", collector_only=False).filter(pl.col("origin") == "csv_monitor")
    joined = csv.join(scalars, on=["name", "global_samples"], suffix="_collector")
    assert joined.height == csv.height > 0
    assert ((joined["value"] - joined["value_collector"]).abs() < 1e-9).all()


def test_the_jobs_own_monitors_agree_through_their_importers(ingested):
    """DeepSpeed wrote the same events to csv_monitor, TensorBoard and an offline W&B run; each is read
    by its own importer (CSV text, TFRecord protobufs, LevelDB-log protobufs) and every point agrees
    with the collector's Monitor backend."""
    scalars = table(ingested["z2"], "scalars", collector_only=False)
    assert set(scalars["origin"]) >= {"collector", "csv_monitor", "tensorboard", "wandb"}
    collector = scalars.filter(pl.col("origin") == "collector").select("name", "global_samples", "value")
    engine_events = collector.filter(pl.col("name").str.starts_with("Train/Samples/"))
    for origin in ("csv_monitor", "tensorboard", "wandb"):
        native = scalars.filter(pl.col("origin") == origin).select("name", "global_samples", "value")
        joined = engine_events.join(native, on=["name", "global_samples"], how="left", suffix="_native")
        assert joined["value_native"].null_count() == 0, origin  # every event the engine wrote is there
        assert ((joined["value"] - joined["value_native"]).abs() <= 1e-6 * joined["value"].abs().clip(1)).all(), origin


def test_step_timers_per_step_match_the_monitor_events(ingested):
    result = ingested["z2"]
    timers = table(result, "step_timers")
    scalars = table(result, "scalars")
    for rank in range(RANKS):
        mine = timers.filter(pl.col("rank") == rank)
        assert set(mine.filter(pl.col("scope") == "global")["timer"]) == {"fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"}
        assert set(mine.filter(pl.col("scope") == "optimizer")["timer"]) >= {"optimizer_step"}
        assert mine.filter(pl.col("timer") == "fwd")["step"].sort().to_list() == list(range(STEPS))
    # DeepSpeed writes Train/Samples/elapsed_time_ms_forward from the same timer just before logging it.
    fwd = timers.filter((pl.col("rank") == 0) & (pl.col("timer") == "fwd")).sort("step")["ms"]
    event = scalars.filter(pl.col("name") == "Train/Samples/elapsed_time_ms_forward").sort("step")["value"]
    assert ((fwd - event).abs() < 1e-6).all()


# --- comms -------------------------------------------------------------------------------------------


def test_comms_latency_per_call_matches_an_independent_wall_clock(ingested, runs):
    """The probe all_reduce: rank 1 enters it 200 ms late; the script timed it on rank 0 itself."""
    calls = table(ingested["z2"], "comms_calls")
    probe = script_record(runs["z2"], 0)["probe"]
    (row,) = calls.filter((pl.col("rank") == 0) & (pl.col("caller") == "probe_comms") & (pl.col("op") == "all_reduce")).rows(named=True)
    wall = probe["end_ns"] - probe["start_ns"]
    assert wall > 150e6  # it did wait for rank 1
    # Per call, inside the script's own span (5 ms: the wrapper's bookkeeping, a busy 2-core machine).
    assert wall - 5e6 < row["latency_ns"] < wall + 1e5  # + 0.1 ms: perf_counter and the wall clock may drift apart
    assert row["step"] == PROBE_STEP and row["msg_bytes"] == probe["msg_bytes"]
    assert row["latency_origin"] == "measured" and row["synchronized"] is False  # gloo on CPU: done when it returns


def test_comms_latencies_are_per_call_not_running_totals(ingested):
    """Each call lies inside its step on the wall clock, so the calls of a step cannot add up to more than
    the step (DeepSpeed's logger, whose totals run on, would exceed it after a few steps)."""
    result = ingested["z2"]
    calls = table(result, "comms_calls").filter(pl.col("caller") != "probe_comms")
    steps = table(result, "train_steps")
    joined = calls.join(steps, on=["rank", "step"], suffix="_step")
    inside = joined.filter(pl.col("caller").is_in(["allreduce_bucket", "get_grad_norm_direct"]))
    assert inside.height == RANKS * STEPS * 2
    assert (inside["ts_ns"] >= inside["start_ns"]).all()
    assert (inside["ts_ns"] + inside["latency_ns"] <= inside["end_ns"]).all()
    per_step = inside.group_by("rank", "step").agg(pl.col("latency_ns").sum(), pl.col("dur_ns").first())
    assert (per_step["latency_ns"] < per_step["dur_ns"]).all()
    # DeepSpeed's own verbose lines are read too, and flagged as running totals.
    flagged = issues(result).filter(pl.col("reason") == "cumulative_comms_latency")
    assert flagged.height >= 1


def test_comms_sizes_and_bandwidth_follow_nccl_tests(ingested):
    calls = table(ingested["z2"], "comms_calls")
    gather = calls.filter(pl.col("op") == "all_gather_into_tensor")
    assert gather.height == RANKS * STEPS
    assert (gather["nccl_bytes"] == gather["msg_bytes"] * gather["group_size"]).all()
    assert (gather["busbw_gbps"] - gather["algbw_gbps"] * 0.5).abs().max() < 1e-12  # (n-1)/n, n = 2
    reduce = calls.filter(pl.col("caller") == "allreduce_bucket")
    assert ((reduce["algbw_gbps"] - reduce["nccl_bytes"] / reduce["latency_ns"]).abs() < 1e-12).all()
    assert (reduce["busbw_gbps"] - reduce["algbw_gbps"]).abs().max() < 1e-12  # 2(n-1)/n = 1
    assert set(calls["group_size"]) == {RANKS}


def test_comms_calls_match_deepspeeds_own_count_and_sizes(runs, ingested):
    """DeepSpeed's comms logger (on in z2) counted the same calls with the same message sizes; only its
    latencies are running totals."""
    calls = table(ingested["z2"], "comms_calls")
    for rank in range(RANKS):
        summary = json.loads((runs["z2"] / "comms" / f"log_summary_rank{rank}.json").read_text())["summary"]
        for op in ("all_reduce", "all_gather_into_tensor"):  # broadcasts also ran inside initialize, before attach
            logged = {int(size): record["count"] for size, record in summary[op].items()}
            ours = calls.filter((pl.col("rank") == rank) & (pl.col("op") == op)).group_by("msg_bytes").len()
            assert dict(ours.iter_rows()) == logged, (rank, op)


def test_ops_deepspeeds_logger_does_not_know_do_not_end_the_job(runs, ingested):
    """all_gather_object and monitored_barrier with the comms logger on: DeepSpeed alone calls exit(0)."""
    calls = table(ingested["z2"], "comms_calls")
    assert set(calls.filter(pl.col("caller") == "main")["op"]) >= {"all_gather_object", "monitored_barrier"}
    for rank in range(RANKS):
        assert len(script_record(runs["z2"], rank)["steps"]) == STEPS


# --- FLOPs and profiler windows ------------------------------------------------------------------------


def test_flops_table_is_exact_per_module(ingested):
    flops = table(ingested["z2"], "flops_profile")
    assert set(flops["rank"]) == {0} and set(flops["profile_step"]) == {2} and flops["exact"].all()
    root = flops.filter(pl.col("path") == "").row(0, named=True)
    assert root["module_class"] == "TinyGPT" and root["depth"] == 0
    assert root["flops_total"] == flops["flops"].sum() and root["macs_total"] == flops["macs"].sum()
    tokens = MICRO_BATCH * SEQ_LEN  # the model sees seq_len inputs per sample
    qkv = flops.filter(pl.col("path") == "blocks.0.qkv").row(0, named=True)
    d_model = 128
    assert qkv["macs"] == tokens * d_model * 3 * d_model and qkv["flops"] == 2 * qkv["macs"]
    assert qkv["params"] == d_model * 3 * d_model + 3 * d_model and qkv["depth"] == 3
    assert not flops["duration_bogus"].any() and root["duration_ns"] > 0


def test_zero3_flops_double_counting_is_flagged(ingested):
    result = ingested["z3"]
    assert "flops_zero3_double_counting" in result.manifest["facts"]["collector_flags"]
    # What the flag says: the same Linear, same input shape, counted twice under ZeRO-3 ...
    z2, z3 = (table(ingested[n], "flops_profile").filter(pl.col("path") == "blocks.0.qkv").row(0, named=True)
              for n in ("z2", "z3"))
    assert z3["macs"] == 2 * z2["macs"]
    assert z3["params"] == z2["params"]  # ... while the parameters (partitioned: ds_numel) are right
    assert "flops_zero3_double_counting" not in ingested["z2"].manifest["facts"]["collector_flags"]


def test_profiler_window_is_a_standard_gzipped_kineto_trace_per_rank(runs, ingested):
    traces = sorted((runs["z2"] / "traces").iterdir())
    assert [p.name.split(".")[0] for p in traces] == ["rank0", "rank1"]
    assert all(p.name.endswith(".pt.trace.json.gz") for p in traces)
    doc = json.loads(gzip.decompress(traces[0].read_bytes()))
    assert doc["distributedInfo"]["rank"] == 0 and doc["traceEvents"]
    steps = pl.read_parquet(ingested["z2"].out_dir / "steps")
    active = PROFILE["skip_first"] + PROFILE["wait"] + PROFILE["warmup"]
    assert sorted(steps["step"].unique().to_list()) == list(range(active, active + PROFILE["active"]))
    assert (runs["z1_gas2_fault"] / "traces").exists() is False  # windows only when asked for


# --- safety ------------------------------------------------------------------------------------------


def test_a_fault_in_a_collector_hook_disables_that_part_only(runs, ingested):
    result = ingested["z1_gas2_fault"]
    for rank in range(RANKS):
        assert len(script_record(runs["z1_gas2_fault"], rank)["steps"]) == 4  # training went on
        assert "injected fault" in result.manifest["facts"][f"collector_rank{rank}"]["disabled"]["timers"]
    assert table(result, "step_timers").is_empty()
    assert not table(result, "train_steps").is_empty() and not table(result, "comms_calls").is_empty()
    disabled = issues(result).filter(pl.col("reason") == "collector_part_disabled")
    assert disabled.height == RANKS


def test_a_killed_rank_leaves_readable_parts_and_analyze_reports_the_missing_tail(runs, ingested):
    run = runs["killed"]
    parts = sorted((run / "collector").glob("*/rank*.parquet"))
    for part in parts:  # every flushed part reads
        assert pq.read_table(part).schema.names == schema.TABLES[part.parent.name][0].names
    # A write cut by the kill can only leave a hidden temporary file, which analyze does not read.
    assert all(p.name.startswith(".") for p in (run / "collector").rglob("*.tmp"))
    manifest = json.loads((run / "collector" / "manifest" / f"rank{KILLED_RANK}.json").read_text())
    assert manifest["status"] == "running"
    result = ingested["killed"]
    status = table(result, "run_status")
    assert status.filter(pl.col("rank") == KILLED_RANK)["status"].to_list() == ["incomplete"]
    (missing,) = issues(result).filter((pl.col("reason") == "collector_missing_tail")
                                       & (pl.col("detail").str.contains(f"rank {KILLED_RANK}"))).rows(named=True)
    assert missing["severity"] == "error"
    # Every step up to the last flush the manifest records is there, and nothing from the kill on (a flush
    # still on its way to the manifest when the kill came may add steps beyond it).
    steps = table(result, "train_steps").filter(pl.col("rank") == KILLED_RANK)["step"].sort().to_list()
    last = manifest["last_flushed_step"]
    assert last is not None and steps == list(range(len(steps))) and last < len(steps) <= KILL_AT_STEP


def test_a_damaged_part_costs_that_part_only(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["z2"] / "collector", run / "collector")
    parts = sorted((run / "collector" / "comms_calls").glob("rank0-*.parquet"))
    damaged = parts[0]
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    result = ingest.ingest(run, jobs=1)
    rel = str(damaged.relative_to(run))
    errors = issues(result).filter(pl.col("severity") == "error")
    assert errors["file"].to_list() == [rel] and errors["reason"].to_list() == ["collector_part_unreadable"]
    calls = table(result, "comms_calls")
    expected = sum(pq.read_table(p).num_rows for p in (run / "collector" / "comms_calls").glob("*.parquet") if p != damaged)
    assert calls.height == expected > 0 and rel not in set(calls["source"])


# --- plain torch and settings ----------------------------------------------------------------------


def test_plain_torch_model_in_reduced_form(tmp_path):
    torch = pytest.importorskip("torch")
    from steplens.collect import attach

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    collector = attach(model, optimizer=optimizer, run_dir=str(tmp_path), samples_per_step=8, flops_step=1,
                       profile={"wait": 0, "warmup": 1, "active": 1}, flush_every=2)
    for _ in range(4):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        collector.log("train/loss", loss.item())
    collector.close()
    result = ingest.ingest(tmp_path, jobs=1)
    steps = table(result, "train_steps").sort("step")
    assert steps["step"].to_list() == [0, 1, 2, 3] and steps["global_samples"].to_list() == [8, 16, 24, 32]
    loss = table(result, "scalars").sort("step")
    assert loss["global_samples"].to_list() == [8, 16, 24, 32]
    flops = table(result, "flops_profile")
    assert flops.filter(pl.col("path") == "0")["macs"].to_list() == [8 * 16 * 32]
    assert len(list((tmp_path / "traces").glob("rank0.*.pt.trace.json.gz"))) == 1
    # The hooks are gone after close.
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_settings_are_checked():
    with pytest.raises(ValueError, match="unknown settings"):
        Settings.parse({"flush_evry": 5})
    with pytest.raises(ValueError, match="bounded"):
        Settings.parse({"profile": {"wait": 1, "warmup": 1, "active": 2, "repeat": 0}})
    assert Settings.parse({"profile": {"active": 2}}).profile == {"skip_first": 0, "wait": 0, "warmup": 1, "active": 2,
                                                                 "repeat": 1}


def test_importer_claims_only_collector_layout(tmp_path):
    assert collector_parts.claims(Path("run/collector/train_steps/rank0-00001.parquet"))
    assert collector_parts.claims(Path("run/collector/manifest/rank3.json"))
    assert not collector_parts.claims(Path("run/collector/train_steps/.rank0-00001.parquet.tmp"))
    assert not collector_parts.claims(Path("run/other/train_steps/rank0-00001.parquet"))
    assert not collector_parts.claims(Path("run/collector/not_a_table/rank0-00001.parquet"))


SAMPLE_MANIFEST = Path(__file__).resolve().parents[1] / "sample_runs/deepspeed_cpu_2rank/collector/manifest/rank0.json"


def write_manifest(tmp_path: Path, content: bytes, rank: int = 0) -> tuple[Path, str]:
    rel = f"collector/manifest/rank{rank}.json"
    path = tmp_path / rel
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    return path, rel


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda text: text[:100], "collector_part_unreadable"),  # cut
    (lambda text: text[:50] + b"\xff\xfe" + text[50:], "collector_part_unreadable"),  # not UTF-8
    (lambda text: b"[" * 100_000 + b"]" * 100_000, "collector_part_unreadable"),  # past the decoder's depth
    (lambda text: b"[1, 2]", "not_a_collector_manifest"),
])
def test_an_unreadable_manifest_is_one_issue_naming_it(tmp_path, damage, reason):
    path, rel = write_manifest(tmp_path, damage(SAMPLE_MANIFEST.read_bytes()))
    result = collector_parts.parse(path, rel)
    assert result.tables == {} and result.facts == {}
    [issue] = result.issues
    assert issue[1:3] == [reason, 1] and rel in issue[3]


@pytest.mark.parametrize("columns", [{"rank": [0.5], "name": ["loss"], "value": [1.0]},
                                     {"rank": [0], "name": ["loss"], "value": ["1.5"]}])
def test_a_part_with_a_column_of_another_type_is_skipped(tmp_path, columns):
    """Cast to the table's types, a float rank would be truncated (0.5 -> 0) and text would fail."""
    rel = "collector/scalars/rank0-00000.parquet"
    (tmp_path / rel).parent.mkdir(parents=True)
    pq.write_table(pa.table(columns), tmp_path / rel)
    result = collector_parts.parse(tmp_path / rel, rel)
    assert result.tables == {}
    [issue] = result.issues
    assert issue[:3] == ["error", "collector_part_columns", 1] and rel in issue[3] and "of other types" in issue[3]


@pytest.mark.parametrize("rewrite", ["polars", "large_string", "dictionary"])
def test_a_part_rewritten_with_its_text_stored_another_way_is_read_as_written(tmp_path, rewrite):
    """A part read and written again by polars (its strings become large_string), or with text stored as a
    dictionary, holds the same values: its rows are read, not skipped as another steplens version's."""
    import polars as pl

    rel = "collector/train_steps/" + sorted(SAMPLE_STEPS.glob("rank0-*.parquet"))[0].name
    original = pq.read_table(SAMPLE_STEPS / Path(rel).name)
    (tmp_path / rel).parent.mkdir(parents=True)
    if rewrite == "polars":
        pl.read_parquet(SAMPLE_STEPS / Path(rel).name).write_parquet(tmp_path / rel)
    else:
        texts = [i for i, f in enumerate(original.schema) if f.type == pa.string()]
        assert texts  # the part has text columns to store another way
        table = original
        for i in texts:
            column = table.column(i)
            table = table.set_column(i, table.schema.field(i).name, column.cast(pa.large_string()) if
                                     rewrite == "large_string" else column.dictionary_encode())
        pq.write_table(table, tmp_path / rel)
    result = collector_parts.parse(tmp_path / rel, rel)
    assert not result.issues
    [frame] = result.tables.values()
    written = original.drop_columns([c for c in ("source",) if c in original.column_names])  # source: the part's path
    assert frame.drop("source").to_arrow().cast(written.schema).equals(written)


SAMPLE_STEPS = SAMPLE_MANIFEST.parents[1] / "train_steps"


def test_a_part_without_a_column_every_collector_writes_is_skipped_and_the_other_ranks_kept(tmp_path):
    """A train_steps part without step and dur_ns was read as rows of nulls, which left every step out, the
    other rank's good ones too. The columns added later (device memory) may be missing: an older collector's."""
    run = tmp_path / "run"
    shutil.copytree(SAMPLE_STEPS, run / "collector" / "train_steps")
    damaged = sorted((run / "collector" / "train_steps").glob("rank1-*.parquet"))[0]
    good = pq.read_table(damaged)
    pq.write_table(good.drop_columns(["step", "dur_ns"]), damaged)
    rel = damaged.relative_to(run).as_posix()
    result = collector_parts.parse(damaged, rel)
    assert result.tables == {}
    [issue] = result.issues
    assert issue[:3] == ["error", "collector_part_columns", 1] and rel in issue[3] and "'dur_ns', 'step'" in issue[3]

    older = tmp_path / "older" / "collector" / "train_steps" / damaged.name
    older.parent.mkdir(parents=True)
    pq.write_table(good.drop_columns([c for c in ("max_allocated_bytes", "max_reserved_bytes") if c in good.column_names]),
                   older)
    kept = collector_parts.parse(older, "older.parquet")
    assert kept.issues == [] and kept.tables["train_steps"]["step"].to_list() == good["step"].to_pylist()

    out = ingest.ingest(run, tmp_path / "out", jobs=1).out_dir
    steps = pl.read_parquet(out / "train_steps")
    expected = sum(pq.read_table(p).num_rows for p in (run / "collector" / "train_steps").glob("rank*.parquet")
                   if p != damaged)
    assert steps.height == expected and steps["step"].null_count() == 0


def test_manifest_values_of_the_wrong_type_are_left_out(tmp_path):
    manifest = json.loads(SAMPLE_MANIFEST.read_text())
    manifest.update(rank="zero", disabled=["timers"], dropped_rows={"scalars": 3, "comms_calls": "x"},
                    rejected_values=[1], run="RUN")
    path, rel = write_manifest(tmp_path, json.dumps(manifest).replace('"RUN"', "1e999").encode(), rank=3)
    result = collector_parts.parse(path, rel)
    assert result.tables["run_status"].select("rank", "status").rows() == [(3, "completed")]  # rank from the file name
    state = result.facts["collector_rank3"]
    completed = json.loads(SAMPLE_MANIFEST.read_text())["steps_completed"]
    assert state["disabled"] is None and state["status"] == "completed" and state["steps_completed"] == completed
    profiler = {"collector_profiler"} if "profiler" in manifest else set()  # what the profiler left attached, if said
    assert set(result.facts) == {"collector_flags", "collector_rank3"} | profiler  # no run facts from a `run` that is a number
    assert [issue[:3] for issue in result.issues] == [["warning", "collector_rank_mismatch", 1],
                                                      ["error", "collector_rows_dropped", 3],
                                                      ["warning", "bad_fact", 4]]
    assert all(key in result.issues[2][3] for key in ("run", "disabled", "dropped_rows", "rejected_values"))


def test_a_second_writer_adds_parts_after_the_existing_ones(tmp_path):
    """A resumed job writing into the same run folder never replaces a part of the first one."""
    from steplens.collect.parts import PartWriter

    for value in (1.0, 2.0):
        writer = PartWriter(tmp_path, 0, ("scalars",), prepare={})
        writer.add("scalars", {"rank": 0, "name": "train/loss", "value": value})
        writer.flush({"status": "completed"}, background=False)
        writer.close()
    parts = sorted((tmp_path / "collector" / "scalars").iterdir())
    assert [p.name for p in parts] == ["rank0-00000.parquet", "rank0-00001.parquet"]
    assert [pq.read_table(p)["value"].to_pylist() for p in parts] == [[1.0], [2.0]]


def test_a_zero3_flops_profile_has_its_linear_flops_halved(ingested):
    """ZeRO-3 profiles count Linear FLOPs twice: the collector flags it and analyze halves every Linear's FLOPs,
    since each shows exactly twice its work (MACs = 2 x params x tokens, the bias aside)."""
    import json

    from steplens.analyze.analyses import runner

    out = ingested["z3"].out_dir
    runner.run(out, runner.Options(peak_tflops=1.0))
    facts = json.loads((out / "run.json").read_text())["facts"]
    assert "flops_zero3_double_counting" in facts["collector_flags"]
    profile = pl.read_parquet(out / "flops_profile")
    tokens = facts["micro_batch"] * facts["seq_len"]
    linear = profile.filter(pl.col("module_class") == "Linear")
    assert ((linear["macs_total"] / (linear["params"] * tokens)) > 1.9).all()
    forward = profile.filter(pl.col("depth") == 0)["flops_total"][0] - linear["flops_total"].sum() / 2
    rows = pl.read_parquet(out / "mfu").filter(pl.col("numerator") == "collector_flops_profile")
    assert rows["flops"].unique().to_list() == [3 * forward * facts["grad_accum"] * facts["dp_world_size"]]


def test_a_zero3_profile_of_multihead_attention_has_its_projections_halved_too():
    """nn.MultiheadAttention makes its projections with functional linear calls of its own (its out_proj child never
    runs), which ZeRO-3 counts twice as it does a Linear's: the helper's job A read 496.5M forward FLOPs per micro
    batch for DeepSpeed's own 395.8M without ZeRO-3. A hand-made profile, E = 8, 2 x 4 tokens: the attention's
    4 E^2 = 256 projection weights x 8 tokens = 2048 MACs, doubled, plus 512 MACs of q.k and attn.v; a Linear of
    144 parameters, 1152 MACs, doubled. Counted once: (2048 + 512 + 1152) x 2 = 7424 FLOPs."""
    from steplens.analyze.analyses import mfu

    def row(path, depth, cls, params, macs):
        return {"path": path, "depth": depth, "module_class": cls, "params": params, "macs_total": macs,
                "flops_total": 2 * macs}

    profile = pl.DataFrame([row("", 0, "LM", 288 + 144, 4608 + 2304), row("attn", 1, "MultiheadAttention", 288, 4608),
                            row("attn.out_proj", 2, "NonDynamicallyQuantizableLinear", 72, 0), row("ff", 1, "Linear", 144, 2304)])
    assert mfu._zero3_corrected(profile, {"micro_batch": 2, "seq_len": 4}) == (7424, "")
    # an attention whose projections cannot be told apart (kdim != E: no 4 E^2 layout) leaves the profile out
    odd = profile.with_columns(params=pl.when(pl.col("path") == "attn").then(300).otherwise(pl.col("params")))
    forward, why = mfu._zero3_corrected(odd, {"micro_batch": 2, "seq_len": 4})
    assert forward is None and "attn (MultiheadAttention)" in why
