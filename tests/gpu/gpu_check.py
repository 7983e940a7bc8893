"""The prepared check on a real GPU: the CUDA paths of the collector and `analyze` (tests/gpu/README.md).

Jobs (tests/realrun/train_tiny_gpt.py, one process on one GPU): a small GPT, bf16, ZeRO-2, 30 steps, one
bounded profiler window with shapes and modules, the collector's FLOPs step, DeepSpeed's comms logger, the
collector with its default alarms (`job`); the same with the collector attached and closed in blocks
(`overhead`); a ZeRO-3 job with two profiler windows (stacks and modules), a FLOPs step and a checkpoint, once
with the collector's CUPTI handling (`z3_released`) and once without (`z3_attached`); ZeRO-3 overhead runs
with and without synchronizing comms timers and comms records. The GPU machine runs only the jobs;
`analyze` and the checks run anywhere:

    python tests/gpu/gpu_check.py prepare          # once, with network: wheels a GPU machine may lack -> .whl/
    bash tests/gpu/device.sh OUT_DIR               # on the GPU machine, from the repository root
    python tests/gpu/gpu_check.py check OUT_DIR    # anywhere steplens is installed: prints a JSON verdict
    python tests/gpu/gpu_check.py --dry-run        # no GPU: the same jobs on CPU (small, fp32) and every
                                                   # check that does not need CUDA

Checks: CUDA kernels linked to their launches, GEMM and attention kernel families, MFU against the matched
device peak (0 < MFU < 100%), per-op roofline rows, the devices in the collector's manifest, the collector
completed with its alarms on, the collector's overhead (median over neighbouring blocks of on / off step time;
target <= 1.02); on the ZeRO-3 jobs: both windows of the process kept, MFU from the analytic count, the
corrected ZeRO-3 profile and the traces' shapes, the after-effect measured (released <= 1.02, attached
reported with its cause when the job's own clock shows it), the CUPTI handling in the manifest, and no bus
bandwidth at world size 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "tests" / "realrun" / "train_tiny_gpt.py"
WHEELS = REPO / ".whl"
DEEPSPEED = "0.19.8"
# A bare CUDA image with torch (the one this was run on) has pyarrow, numpy, psutil, ninja, py-cpuinfo, einops, msgpack, tqdm,
# nvidia-ml-py and prometheus-client, but not these (deepspeed itself is a source package: built here).
DEVICE_WHEELS = ("hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "polars",
                 "polars-runtime-32")
BLOCK = 10  # overhead run: collector on for BLOCK steps, off for BLOCK steps, ...

GPU_JOB = ("--zero_stage", "2", "--bf16", "--steps", "30", "--model", "32768,1024,16,8", "--seq_len", "1024",
           "--micro_batch", "8", "--dist_backend", "nccl", "--flush_every", "10", "--flops_step", "5",
           "--profile_skip_first", "12", "--profile_window", "1,1,1,1", "--profile_modules",
           "--comms_logger", "summary", "--log_level", "info")
GPU_OVERHEAD = ("--zero_stage", "2", "--bf16", "--steps", str(8 * BLOCK), "--model", "32768,1024,16,8",
                "--seq_len", "1024", "--micro_batch", "8", "--dist_backend", "nccl", "--flush_every", "10",
                "--flops_step", "-1", "--profile_window", "off", "--collector_ab", str(BLOCK))
# Issue 35: a ZeRO-3 job with two profiler windows (stacks and modules), a FLOPs step and a checkpoint, run with
# the collector's CUPTI handling (its default) and without it (cupti_teardown off): the steps after the windows
# against those before. Windows at steps 12 and 15 (exports 13 and 16), checkpoint after step 35.
Z3_JOB = ("--zero_stage", "3", "--bf16", "--steps", "50", "--model", "32768,1024,16,8", "--seq_len", "1024",
          "--micro_batch", "8", "--dist_backend", "nccl", "--flush_every", "10", "--flops_step", "5",
          "--profile_skip_first", "10", "--profile_window", "1,1,1,2", "--profile_modules", "--profile_stack",
          "--save_checkpoint_at", "35", "--comms_logger", "summary", "--log_level", "info")
Z3_BLOCKS = int(os.environ.get("STEPLENS_GPU_Z3_BLOCKS", 8))  # the ZeRO-3 overhead runs: Z3_BLOCKS blocks of BLOCK steps, collector on and off in turn
Z3_OVERHEAD = ("--zero_stage", "3", "--bf16", "--steps", str(Z3_BLOCKS * BLOCK), "--model", "32768,1024,16,8",
               "--seq_len", "1024", "--micro_batch", "8", "--dist_backend", "nccl", "--flush_every", "10",
               "--flops_step", "-1", "--profile_window", "off", "--collector_ab", str(BLOCK))
# name -> (switches, what it is)
GPU_JOBS = {
    "job": (GPU_JOB, "ZeRO-2, one window"),
    "overhead": (GPU_OVERHEAD, "ZeRO-2, collector on/off in blocks"),
    "z3_released": (Z3_JOB, "ZeRO-3, two windows, the collector's CUPTI handling"),
    "z3_attached": (Z3_JOB + ("--cupti_teardown", "off"), "ZeRO-3, two windows, CUPTI left attached"),
    "z3_overhead": (Z3_OVERHEAD, "ZeRO-3, collector on/off in blocks, synchronizing comms timers"),
    "z3_overhead_nosync": (Z3_OVERHEAD + ("--comms_synchronize", "off"), "the same, comms timers not synchronizing"),
    "z3_overhead_nocomms": (Z3_OVERHEAD + ("--collector_comms", "off"), "the same, no comms records"),
}
# The dry run: the same switches on CPU, small and short.
CPU_JOB = ("--zero_stage", "2", "--steps", "6", "--flush_every", "3", "--flops_step", "2", "--profile_skip_first",
           "2", "--profile_window", "1,1,1,1", "--profile_modules", "--comms_logger", "summary", "--log_level", "info")
CPU_OVERHEAD = ("--zero_stage", "2", "--steps", "8", "--flush_every", "2", "--flops_step", "-1", "--profile_window",
                "off", "--collector_ab", "2")
CPU_Z3 = ("--zero_stage", "3", "--steps", "16", "--flush_every", "3", "--flops_step", "1", "--profile_skip_first", "4",
          "--profile_window", "1,1,1,2", "--profile_modules", "--profile_stack", "--save_checkpoint_at", "12",
          "--comms_logger", "summary", "--log_level", "info")  # windows 6 and 9, FLOPs step 1, save before step 13
CPU_Z3_OVERHEAD = ("--zero_stage", "3", "--steps", "8", "--flush_every", "2", "--flops_step", "-1", "--profile_window",
                   "off", "--collector_ab", "2")
# On CPU the CUPTI and comms variants run the same code as their siblings: one of each kind keeps CI short.
CPU_JOBS = {"job": CPU_JOB, "overhead": CPU_OVERHEAD, "z3_released": CPU_Z3, "z3_overhead": CPU_Z3_OVERHEAD}


def prepare() -> None:
    """Wheels for the device's Python 3.12: the ones its image lacks, and a pure-Python DeepSpeed."""
    WHEELS.mkdir(exist_ok=True)
    exclude = REPO / subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=REPO, check=True,
                                    capture_output=True, text=True).stdout.strip()
    if not exclude.exists() or "/.whl/" not in exclude.read_text():  # the wheels are copied with the tree, never committed
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with open(exclude, "a") as f:
            f.write("/.whl/\n")
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28)] + ["--platform=manylinux2014_x86_64"]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", *platforms, "-d", str(WHEELS), *DEVICE_WHEELS], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "download", "--no-deps", "--no-binary=:all:", "-d", tmp, f"deepspeed=={DEEPSPEED}"],
                       check=True)
        (sdist,) = Path(tmp).glob("deepspeed-*")
        # No compiled ops: the job uses torch's own Adam ("torch_adam") and needs none.
        subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(WHEELS), str(sdist)], check=True,
                       env={**os.environ, "DS_BUILD_OPS": "0"})
    print("\n".join(sorted(p.name for p in WHEELS.glob("*.whl"))))


def run_job(out: Path, args: tuple[str, ...], gpu: bool) -> Path:
    """One process (rank 0 of 1), started the way the launcher would; output in out/launcher.log."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29500 + os.getpid() % 1000), "PYTHONPATH": os.pathsep.join(
               p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)}
    if not gpu:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    with open(out / "launcher.log", "wb") as log:
        done = subprocess.run([sys.executable, str(TRAIN), "--out_dir", str(out), *args], stdout=log,
                              stderr=subprocess.STDOUT, env=env, cwd=out)
    if done.returncode != 0:
        raise SystemExit(f"job failed ({done.returncode}):\n{(out / 'launcher.log').read_text()[-3000:]}")
    return out


def overhead(run: Path, block: int) -> dict:
    """Median over neighbouring block pairs of (collector on) / (off) median step time; the first pair left out
    (warm-up). As tests/benchmarks/bench_collector.py computes it."""
    steps = json.loads((run / "script" / "rank0.json").read_text())["steps"]
    blocks: dict[int, dict] = {}
    for step in steps:
        entry = blocks.setdefault(step["step"] // block, {"on": step["collector_on"], "ms": []})
        entry["ms"].append((step["end_ns"] - step["start_ns"]) / 1e6)
    medians = [(b["on"], statistics.median(b["ms"])) for _, b in sorted(blocks.items())][1:]
    ratios = [(a if on_first else b) / (b if on_first else a)
              for (on_first, a), (_, b) in zip(medians[::2], medians[1::2])]
    return {"ratio": statistics.median(ratios) if ratios else None, "pairs": len(ratios),
            "median_on_ms": statistics.median(m for on, m in medians if on),
            "median_off_ms": statistics.median(m for on, m in medians if not on)}


# What comes back: everything but checkpoints, in two archives so that the small one (collector parts, logs, step
# records) returns even when the ZeRO-3 jobs' traces (with stacks) exceed what a transfer takes.
ARCHIVES = {"gpu_run": lambda name: "/checkpoints" not in name and not ("/z3_" in name and "/traces" in name),
            "gpu_traces": lambda name: "/z3_" in name and "/traces" in name}


def pack(run: Path, out: Path, part_bytes: int = 15 * 2**20) -> None:
    """As device.sh does: the job folders in two gzipped tars, each split into parts of at most 15 MiB."""
    out.mkdir(parents=True, exist_ok=True)
    for archive_name, wanted in ARCHIVES.items():
        archive = out.parent / f"{archive_name}.tgz"
        with tarfile.open(archive, "w:gz") as tar:
            for path in sorted(run.rglob("*")):
                name = "gpu_run/" + path.relative_to(run).as_posix()
                if path.is_file() and wanted(name):
                    tar.add(path, name)
        data = archive.read_bytes()
        for index, start in enumerate(range(0, len(data), part_bytes)):
            (out / f"{archive_name}.tgz.part-a{chr(ord('a') + index)}").write_bytes(data[start:start + part_bytes])


def unpack(folder: Path) -> Path:
    """The parts under `folder` (read-only, as fetched) joined per archive and extracted into a new folder: its
    gpu_run/. A run packed before the traces had their own archive has only gpu_run.tgz."""
    root = Path(tempfile.mkdtemp(prefix="steplens_gpu_run_"))
    for archive_name in ARCHIVES:
        parts = sorted(folder.rglob(f"{archive_name}.tgz.part-*"))
        if not parts:
            continue
        with open(root / f"{archive_name}.tgz", "wb") as archive:
            for part in parts:
                archive.write(part.read_bytes())
        with tarfile.open(root / f"{archive_name}.tgz") as tar:
            tar.extractall(root, filter="data")
    if not (root / "gpu_run").is_dir():
        raise SystemExit(f"no gpu_run.tgz.part-* under {folder}")
    return root / "gpu_run"


def script_regimes(run: Path, first_window: int, last_window: int, skip: set[int]) -> dict:
    """The job script's own step times (script/rank0.json, no steplens code): median before the first window
    (from step 3) and after the last window's export step, `skip` left out; their ratio."""
    steps = json.loads((run / "script" / "rank0.json").read_text())["steps"]
    ms = {s["step"]: (s["end_ns"] - s["start_ns"]) / 1e6 for s in steps}
    before = [t for step, t in ms.items() if 3 <= step < first_window - 1 and step not in skip]
    after = [t for step, t in ms.items() if step > last_window + 1 and step not in skip]
    if not before or not after:
        return {"ratio": None}
    return {"before_ms": statistics.median(before), "after_ms": statistics.median(after),
            "ratio": statistics.median(after) / statistics.median(before), "steps_before": len(before),
            "steps_after": len(after)}


def check(root: Path, gpu: bool) -> dict:
    """analyze the job folder and the checks; each is ok, failed (with why) or skipped (with why)."""
    import polars as pl
    from steplens.analyze.analyses import runner
    from steplens.analyze.pipeline import ingest
    from steplens.analyze import analyses

    job, results = root / "job", {}
    result = ingest.ingest(job, jobs=1)
    findings = runner.run(result.out_dir, runner.Options(dtype="bf16" if gpu else "fp32"))
    table = lambda name: pl.read_parquet(result.out_dir / name)  # noqa: E731

    def verdict(name: str, ok: bool, detail, needs_gpu: bool = False) -> None:
        results[name] = {"status": "skipped" if needs_gpu and not gpu else ("ok" if ok else "failed"), "detail": detail}

    events = table("trace_events")
    kernels = events.filter(pl.col("kind") == "kernel")
    linked = kernels["launch_event_id"].is_not_null().mean() if kernels.height else 0.0
    verdict("kernels_linked", kernels.height > 0 and linked >= 0.99,
            f"{kernels.height} kernels, {linked:.1%} linked to a launch", needs_gpu=True)
    families = set(table("kernel_categories")["category"].drop_nulls())
    verdict("gemm_and_attention", {"gemm", "attention"} <= families, sorted(families), needs_gpu=True)
    mfu = table("mfu").filter(pl.col("utilization").is_not_null())
    peaks = sorted(set(mfu["peak"].drop_nulls())) if mfu.height else []
    verdict("mfu_below_peak", mfu.height > 0 and bool(((mfu["utilization"] > 0) & (mfu["utilization"] < 1)).all())
            and any("H200" in p or "h200" in p for p in peaks), {"rows": mfu.height, "peaks": peaks,
            "utilization": mfu["utilization"].to_list()[:6]}, needs_gpu=True)
    roofline = [name for name, (_, columns) in analyses.TABLES.items() if {"bound", "fraction_of_peak"} <= set(columns)]
    if roofline:
        rows = table(roofline[0]).filter(pl.col("bound").is_not_null())
        verdict("roofline_rows", rows.height > 0, f"{rows.height} rows in {roofline[0]}", needs_gpu=True)
    else:
        results["roofline_rows"] = {"status": "skipped", "detail": "this analyze has no per-op roofline table"}
    manifest = json.loads((job / "collector" / "manifest" / "rank0.json").read_text())
    devices = json.dumps(manifest.get("host", {}))
    verdict("devices_in_manifest", "H200" in devices, manifest.get("host", {}).get("devices"), needs_gpu=True)
    verdict("collector_completed", manifest["status"] == "completed" and not manifest["disabled"]
            and manifest.get("alarms") is not None, {"status": manifest["status"], "disabled": manifest["disabled"],
                                                     "alarms": manifest.get("alarms")})
    verdict("profiler_window", (job / "traces").is_dir() and any((job / "traces").glob("rank0.*.pt.trace.json.gz"))
            and events.height > 0, f"{events.height} events")
    flops = table("flops_profile").filter(pl.col("source").str.starts_with("collector/"))
    verdict("flops_profile", flops.height > 0 and bool(flops["exact"].all()), f"{flops.height} modules")
    cost = overhead(root / "overhead", BLOCK if gpu else 2)
    verdict("collector_overhead", cost["ratio"] is not None and (cost["ratio"] <= 1.02 or not gpu), cost)
    results["findings_mfu"] = findings.get("mfu")
    for name in ("z3_released", "z3_attached"):
        if (root / name).is_dir():
            results.update(check_zero3(root / name, name, gpu))
    for name in ("z3_overhead", "z3_overhead_nosync", "z3_overhead_nocomms"):
        if (root / name / "script").is_dir():
            cost = overhead(root / name, BLOCK if gpu else 2)
            results[f"{name}_ratio"] = {"status": "ok" if cost["ratio"] is not None and (cost["ratio"] <= 1.02 or not gpu)
                                        else "failed", "detail": cost}
    return results


def check_zero3(job: Path, name: str, gpu: bool) -> dict:
    """Issue 35's items on one ZeRO-3 job with two windows: each is ok, failed or skipped, with the figures."""
    import polars as pl
    from steplens.analyze.analyses import runner
    from steplens.analyze.pipeline import ingest

    results: dict = {}
    result = ingest.ingest(job, out_dir=job.parent / f".{name}_out", jobs=1)
    findings = runner.run(result.out_dir, runner.Options(dtype="bf16" if gpu else "fp32"))

    def verdict(check: str, ok: bool, detail) -> None:
        results[f"{name}_{check}"] = {"status": "ok" if ok else "failed", "detail": detail}

    traces = [s for s in result.sources if s.path.startswith("traces/")]
    verdict("windows_kept", len(traces) == 2 and all(s.status == "ingested" for s in traces),
            {s.path: s.status for s in traces})
    numerators = {r["numerator"]: round(r["utilization"], 4) for r in findings.get("mfu") or [] if isinstance(r, dict)}
    verdict("mfu_numerators", {"palm", "collector_flops_profile", "trace_shapes"} <= set(numerators) or not gpu,
            {"numerators": numerators, "disagree": findings.get("mfu_numerators_disagree")})
    effect = findings.get("profiler_after_effect") or {}
    own = script_regimes(job, *((12, 15) if gpu else (6, 9)), {5, 36} if gpu else {1, 13})
    manifest = json.loads((job / "collector" / "manifest" / "rank0.json").read_text())
    released = (manifest.get("profiler") or {}).get("cupti_teardown")
    if name == "z3_released":
        verdict("after_effect", effect.get("ratio") is not None and (effect["ratio"] <= 1.02 or not gpu),
                {"analyze": effect, "script": own})
        verdict("cupti_released", released is True or not gpu, manifest.get("profiler"))
    else:
        slowed = (own.get("ratio") or 0) > 1.05
        verdict("after_effect_reported", not slowed or bool(effect.get("beyond_noise")), {"analyze": effect, "script": own})
        verdict("cupti_attached", released is False or not gpu, manifest.get("profiler"))
    stats = pl.read_parquet(result.out_dir / "comms_log_stats")
    verdict("no_busbw_at_world_size_1", stats.is_empty() or stats["median_busbw_gbps"].null_count() == stats.height,
            stats.select("op", "group_size", "median_busbw_gbps").head(5).to_dicts())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["prepare", "job", "check"], help="prepare | job | check")
    parser.add_argument("folder", nargs="?", help="job: where to write the runs; check: the folder holding them")
    parser.add_argument("--dry-run", action="store_true", help="No GPU: small CPU jobs, then the checks that apply.")
    args = parser.parse_args()
    if args.command == "prepare":
        return prepare()
    if args.command == "job":  # on the GPU machine
        root, summary = Path(args.folder), {}
        only = os.environ.get("STEPLENS_GPU_ONLY")  # e.g. "z3_overhead,z3_overhead_nosync": a rerun of some jobs
        for name, (switches, what) in GPU_JOBS.items():
            if only and name not in only.split(","):
                continue
            started = time.monotonic()
            run_job(root / name, switches, gpu=True)
            summary[name] = {"what": what, "seconds": round(time.monotonic() - started, 1)}
            if name.startswith("z3_overhead") or name == "overhead":
                summary[name].update(overhead(root / name, BLOCK))
            elif name.startswith("z3_"):  # windows at 12 and 15, FLOPs step 5, checkpoint save before step 36
                summary[name].update(script_regimes(root / name, 12, 15, {5, 36}))
            print(name, json.dumps(summary[name]), flush=True)
        (root / "summary.json").write_text(json.dumps(summary, indent=1))
        return None
    if args.command == "check":
        results = check(unpack(Path(args.folder)), gpu=True)
    elif args.dry_run:
        root = Path(tempfile.mkdtemp(prefix="steplens_gpu_dry_run_"))
        for name, switches in CPU_JOBS.items():
            run_job(root / "gpu_run" / name, switches, gpu=False)
        pack(root / "gpu_run", root / "out")  # and back, as a device run comes back
        results = check(unpack(root / "out"), gpu=False)
    else:
        parser.error("a command, or --dry-run")
    print(json.dumps(results, indent=1, default=str))
    failed = [name for name, r in results.items() if isinstance(r, dict) and r.get("status") == "failed"]
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
