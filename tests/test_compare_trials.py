"""`steplens trials` and `steplens compare` on real repeated DeepSpeed jobs, and what logs-only runs
give (Megatron MFU, DeepSpeed-Chat global_samples). Every number is recomputed here from the raw
collector Parquet parts (pyarrow) or the log text (re), with the standard library: no steplens code."""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import statistics
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from conftest import TRIAL_MICRO_BATCHES, TRIAL_REPEATS
from steplens.analyze.importers import deepspeed_log
from steplens.analyze.analyses import trials
from steplens.analyze.analyses.mfu import NUMERATOR_WORDS as mfu_words_table
from steplens.analyze.cli import EXIT_REGRESSION, analyze, steplens


# ---------------------------------------------------------------------------------------------
# The step-time definition, recomputed from the raw collector parts


def _raw_steps(run: Path) -> list[tuple[int, int, int]]:
    """(step, step time ns, samples) per optimizer step: the slowest rank's cycle (the end of its step before to the
    end of this one; the first step has none and is left out), samples from global_samples after the boundary; the
    leading warm-up steps left out (above median + max(3.5 MAD / 0.6745, 5% of the median), at most half the steps)."""
    ends: dict[int, dict[int, int]] = {}
    samples_after: dict[int, int] = {}
    for part in sorted((run / "collector" / "train_steps").glob("*.parquet")):
        for row in pq.read_table(part).to_pylist():
            ranks = ends.setdefault(row["step"], {})
            ranks[row["rank"]] = max(ranks.get(row["rank"], row["end_ns"]), row["end_ns"])
            if row["is_boundary"]:
                samples_after[row["step"]] = max(samples_after.get(row["step"], 0), row["global_samples"])
    steps = [s for s in sorted(ends) if s - 1 in ends and ends[s - 1].keys() >= ends[s].keys()]
    times = [max(end - ends[s - 1][rank] for rank, end in ends[s].items()) for s in steps]
    warm = _warm_up(times)
    return [(s, times[i], samples_after[s] - samples_after.get(s - 1, 0)) for i, s in enumerate(steps) if i >= warm]


def _warm_up(times: list[float]) -> int:
    """How many leading steps are warm-up: above median + max(3.5 MAD / 0.6745, 5% of the median),
    at most half of them; none below 3 steps."""
    if len(times) < 3:
        return 0
    median = statistics.median(times)
    bound = median + max(3.5 * statistics.median(abs(t - median) for t in times) / 0.6745, 0.05 * median)
    warm = 0
    while warm < len(times) and times[warm] > bound:
        warm += 1
    return min(warm, len(times) // 2)


def _exact_one_sided_p(winner: list[float], runner: list[float]) -> tuple[float, float]:
    """U (pairs where the winner's trial is higher) and the exact one-sided p: the share of all
    C(n+m, n) splits of the pooled values whose U is at least as large (no ties in real timings)."""
    def u(a, b):
        return sum((x > y) + 0.5 * (x == y) for x in a for y in b)

    observed, pooled = u(winner, runner), winner + runner
    splits = list(itertools.combinations(range(len(pooled)), len(winner)))
    as_large = sum(u([pooled[i] for i in chosen], [pooled[i] for i in range(len(pooled)) if i not in chosen]) >= observed
                   for chosen in splits)
    return observed, as_large / len(splits)


# ---------------------------------------------------------------------------------------------
# trials


def test_trials_group_real_repeats_by_work_and_rank_them(ds_trial_runs):
    result = CliRunner().invoke(steplens, ["trials", str(ds_trial_runs), "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # 4 + 4 runs with a run_dir of their own in the "steplens" block: two configurations of 4 trials.
    by_batch = {c["micro_batch"]: c for c in data["configurations"]}
    assert sorted(by_batch) == list(TRIAL_MICRO_BATCHES)
    throughput = {}
    for micro_batch, config in by_batch.items():
        assert sorted(config["runs"]) == [f"mbs{micro_batch}_run{i}" for i in range(TRIAL_REPEATS)]
        assert config["trials"] == config["ok_trials"] == TRIAL_REPEATS
        assert config["ignored_differences"] == ["steplens.run_dir"]
        values = []
        for name in config["runs"]:
            steps = _raw_steps(ds_trial_runs / name)
            values.append(statistics.median(s[2] for s in steps) / (statistics.median(s[1] for s in steps) / 1e9))
        throughput[micro_batch] = values
        assert config["median"] == pytest.approx(statistics.median(values), rel=1e-9)
        assert (config["min"], config["max"]) == pytest.approx((min(values), max(values)), rel=1e-9)
    assert data["ignored_differences"] == ["steplens.run_dir"] and "steplens" in data["ignored_rule"]
    winner, runner = sorted(TRIAL_MICRO_BATCHES, key=lambda mb: statistics.median(throughput[mb]), reverse=True)
    verdict = data["verdict"]
    assert verdict["winner"] == by_batch[winner]["configuration"] and verdict["runner_up"] == by_batch[runner]["configuration"]
    statistic, p_value = _exact_one_sided_p(throughput[winner], throughput[runner])
    assert verdict["test"] == "mann_whitney_u_exact_one_sided"
    assert verdict["statistic"] == statistic and verdict["p_value"] == pytest.approx(p_value)
    assert verdict["established"] is (p_value < 0.05) and data["alpha"] == 0.05
    text = CliRunner().invoke(steplens, ["trials", str(ds_trial_runs)])
    assert text.exit_code == 0 and "ignored settings that differed between trials: steplens.run_dir" in text.stdout


def test_work_config_sets_aside_only_what_does_not_change_the_work():
    base = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
            "steplens": {"run_dir": "runs/a", "seq_len": 64, "flush_every": 4},
            "csv_monitor": {"enabled": True, "output_path": "out/a"}, "wall_clock_breakdown": False}
    other_outputs = {**base, "steplens": {"run_dir": "runs/b", "seq_len": 64, "flush_every": 50},
                     "csv_monitor": {"enabled": True, "output_path": "out/b"}, "wall_clock_breakdown": True,
                     "tensorboard": {"enabled": True, "output_path": "tb"}, "flops_profiler": {"enabled": True}}
    work, ignored = trials.work_config(base, 2)
    assert trials.work_config(other_outputs, 2)[0] == work
    assert ignored == {"steplens": base["steplens"], "csv_monitor": base["csv_monitor"], "wall_clock_breakdown": False}
    # The work itself: micro batch, sequence length, world size, a nested output path kept apart from the rest.
    assert trials.work_config({**base, "train_micro_batch_size_per_gpu": 8}, 2)[0] != work
    assert trials.work_config({**base, "steplens": {"run_dir": "runs/a", "seq_len": 128}}, 2)[0] != work
    assert trials.work_config(base, 4)[0] != work
    nested = {**base, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "output_path": "x"}}}
    assert trials.work_config(nested, 2)[1]["zero_optimization.offload_optimizer.output_path"] == "x"


# ---------------------------------------------------------------------------------------------
# compare


def _u_two_sided(base: list[float], new: list[float]) -> float:
    return sum((n > b) + 0.5 * (n == b) for n in new for b in base)


def test_compare_judges_throughput_when_the_micro_batch_differs(ds_trial_runs, tmp_path):
    small, large = (ds_trial_runs / f"mbs{mb}_run0" for mb in TRIAL_MICRO_BATCHES)
    runner = CliRunner()
    result = runner.invoke(steplens, ["compare", str(small), str(large), "--out", str(tmp_path / "c"), "--format", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    verdict = data["verdict"]
    # Both collector manifests record seq_len 64 (the steplens block): tokens/s, said so.
    assert verdict["metric"] == "tokens/s" and "train_micro_batch_size_per_gpu" in verdict["why_metric"]
    rates = {}
    for side, run in (("base", small), ("new", large)):
        steps = _raw_steps(run)
        rates[side] = [samples * 64 / (ns / 1e9) for _, ns, samples in steps]
        assert verdict[f"{side}_median"] == pytest.approx(statistics.median(rates[side]), rel=1e-9)
        assert verdict[f"{side}_n"] == len(steps)
        assert data["step_time"][f"{side}_median_ns"] == pytest.approx(statistics.median(ns for _, ns, _ in steps))
    assert verdict["delta"] == pytest.approx(statistics.median(rates["new"]) / statistics.median(rates["base"]) - 1)
    assert verdict["statistic"] == _u_two_sided(rates["base"], rates["new"])
    assert verdict["verdict"] in ("regression", "improvement", "within noise")
    beyond_noise = verdict["p_value"] < 0.05 and (verdict["ci_low"] > 0 or verdict["ci_high"] < 0)
    assert (verdict["verdict"] != "within noise") is beyond_noise is verdict["established"]
    assert verdict["test"] == "mann_whitney_u_two_sided"
    if verdict["verdict"] != "within noise":  # the direction is the throughput's: more tokens/s is better
        assert (verdict["verdict"] == "improvement") is (verdict["delta"] > 0)
    # --fail-on-regression judges the same metric: exit 3 exactly when tokens/s fell significantly.
    for base, new in ((small, large), (large, small)):
        gated = runner.invoke(steplens, ["compare", str(base), str(new), "--out", str(tmp_path / "g"), "--format", "json",
                                         "--fail-on-regression", "1"])
        judged = json.loads(gated.stdout)["verdict"]
        regressed = judged["verdict"] == "regression" and abs(judged["delta"]) > 0.01
        assert gated.exit_code == (EXIT_REGRESSION if regressed else 0), gated.output
        assert judged["metric"] == "tokens/s"
    text = runner.invoke(steplens, ["compare", str(small), str(large), "--out", str(tmp_path / "t")])
    assert f"tokens/s: {verdict['verdict']}" in text.stdout and "judged on tokens/s" in text.stdout
    assert f"Tokens/s: {verdict['verdict']}" in (tmp_path / "t" / "compare.md").read_text()


def _collector_run(folder: Path, micro_batch: int, step_ms: list[float], seq_len: int = 64) -> Path:
    """A 2-rank collector run folder: the bundled sample's manifests with another micro batch, and
    optimizer steps of the given durations on both ranks: each ends its duration after the one before it ended (a
    step's time is its cycle, the end of the step before to its own end; its forward-to-step part is 1 ms shorter),
    after one more step first that starts the first one's cycle (it has no step before it itself)."""
    import pyarrow as pa

    from steplens.analyze.contract import schema

    sample = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank" / "collector" / "manifest"
    (folder / "collector" / "manifest").mkdir(parents=True)
    (folder / "collector" / "train_steps").mkdir(parents=True)
    for rank in (0, 1):
        manifest = json.loads((sample / f"rank{rank}.json").read_text())
        manifest["run"].update(micro_batch=micro_batch, train_batch_size=2 * micro_batch, seq_len=seq_len)
        manifest["run"]["settings"]["seq_len"] = seq_len
        manifest["run"]["ds_config"]["train_micro_batch_size_per_gpu"] = micro_batch
        manifest["run"]["settings"].update(profile=None, flops_step=None)  # no instrumented steps
        (folder / "collector" / "manifest" / f"rank{rank}.json").write_text(json.dumps(manifest))
        start, rows = 1_000_000_000, []
        for step, ms in enumerate([step_ms[0], *step_ms]):
            end = start + round(ms * 1e6) - 1_000_000
            rows.append({"rank": rank, "source": "collector", "step": step, "micro_step": step, "start_ns": start,
                         "end_ns": end, "dur_ns": end - start, "is_boundary": True,
                         "global_samples": 2 * micro_batch * (step + 1)})
            start = end + 1_000_000
        pq.write_table(pa.Table.from_pylist(rows, schema=schema.TRAIN_STEPS),
                       folder / "collector" / "train_steps" / f"rank{rank}-00000.parquet")
    return folder


def test_a_bigger_batch_with_longer_steps_is_not_a_regression(tmp_path):
    """The issue's case: micro batch 8 -> 32, steps 26% longer, samples/s up 3.2x. Hand-computed:
    tokens per step 2 ranks x 8 x 64 = 1,024 vs 4,096; steps of 100..107 ms and 126..133 ms; every
    larger-batch step beats every smaller-batch one: U = 64, exact two-sided p = 2 / C(16, 8)."""
    small = _collector_run(tmp_path / "mbs8", 8, [100 + i for i in range(8)])
    large = _collector_run(tmp_path / "mbs32", 32, [126 + i for i in range(8)])
    runner = CliRunner()
    better = runner.invoke(steplens, ["compare", str(small), str(large), "--out", str(tmp_path / "a"), "--format", "json",
                                      "--fail-on-regression", "5"])
    assert better.exit_code == 0, better.output
    verdict = json.loads(better.stdout)["verdict"]
    assert verdict["metric"] == "tokens/s" and verdict["verdict"] == "improvement" and verdict["established"] is True
    # Median of the per-step rates: the mean of the 4th and 5th fastest steps' rates.
    assert verdict["base_median"] == pytest.approx((1024 / 0.103 + 1024 / 0.104) / 2)
    assert verdict["new_median"] == pytest.approx((4096 / 0.129 + 4096 / 0.130) / 2)
    assert verdict["statistic"] == 64 and verdict["p_value"] == pytest.approx(2 / math.comb(16, 8))
    # the other way round it is a regression past the threshold: exit 3, with a line saying so (it said nothing)
    worse = runner.invoke(steplens, ["compare", str(large), str(small), "--out", str(tmp_path / "b"),
                                     "--fail-on-regression", "5"])
    assert worse.exit_code == EXIT_REGRESSION
    drop = 1 - ((1024 / 0.103 + 1024 / 0.104) / 2) / ((4096 / 0.129 + 4096 / 0.130) / 2)
    assert f"tokens/s regressed by {drop:.1%}, beyond --fail-on-regression 5%" in " ".join(worse.stderr.split())
    assert json.loads(better.stdout)["step_time"]["new_median_ns"] == pytest.approx(129.5e6)
    worse = runner.invoke(steplens, ["compare", str(large), str(small), "--out", str(tmp_path / "b"),
                                     "--fail-on-regression", "5"])
    assert worse.exit_code == EXIT_REGRESSION and "tokens/s: regression" in worse.stdout
    assert runner.invoke(steplens, ["compare", str(large), str(small), "--out", str(tmp_path / "c"),
                                    "--fail-on-regression", "80"]).exit_code == 0  # -75% is within an 80% allowance


def test_a_longer_sequence_is_judged_on_tokens(tmp_path):
    """Same batch, sequence 64 -> 128, steps 100..107 ms -> 150..157 ms: 1.5x the step time for 2x
    the tokens is an improvement in tokens/s, not a step-time regression."""
    short = _collector_run(tmp_path / "s64", 8, [100 + i for i in range(8)])
    long = _collector_run(tmp_path / "s128", 8, [150 + i for i in range(8)], seq_len=128)
    result = CliRunner().invoke(steplens, ["compare", str(short), str(long), "--out", str(tmp_path / "c"), "--format", "json",
                                           "--fail-on-regression", "5"])
    assert result.exit_code == 0, result.output
    verdict = json.loads(result.stdout)["verdict"]
    assert verdict["metric"] == "tokens/s" and verdict["verdict"] == "improvement" and "seq_len" in verdict["why_metric"]
    assert verdict["new_median"] == pytest.approx((16 * 128 / 0.153 + 16 * 128 / 0.154) / 2)


def test_compare_judges_step_time_when_the_work_is_the_same(ds_trial_runs, tmp_path):
    first, second = (ds_trial_runs / f"mbs{TRIAL_MICRO_BATCHES[0]}_run{i}" for i in (0, 1))
    result = CliRunner().invoke(steplens, ["compare", str(first), str(second), "--out", str(tmp_path), "--format", "json"])
    verdict = json.loads(result.stdout)["verdict"]
    assert verdict["metric"] == "step time" and verdict["unit"] == "ns"
    base, new = ([ns for _, ns, _ in _raw_steps(run)] for run in (first, second))
    assert verdict["base_median"] == pytest.approx(statistics.median(base))
    assert verdict["new_median"] == pytest.approx(statistics.median(new))
    assert verdict["statistic"] == _u_two_sided(base, new)


def test_compare_names_the_inputs_a_run_lost_and_exits_1(tmp_path):
    """A run whose analysis exited 1 (a damaged collector part) was compared with exit 0 and not a word."""
    sample = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"
    base, new = tmp_path / "base", tmp_path / "new"
    for run in (base, new):
        shutil.copytree(sample, run)
    damaged = sorted((new / "collector" / "train_steps").glob("rank1-*.parquet"))[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    runner = CliRunner()
    whole = runner.invoke(steplens, ["compare", str(base), str(base), "--out", str(tmp_path / "same")])
    assert whole.exit_code == 0 and "lost data" not in whole.stdout
    result = runner.invoke(steplens, ["compare", str(base), str(new), "--out", str(tmp_path / "cmp"), "--format", "json"])
    assert result.exit_code == 1
    [warning] = [w for w in json.loads(result.stdout)["warnings"] if "lost data" in w]
    assert warning.startswith("the new run's analysis lost data from 1 input(s)")
    assert damaged.relative_to(new).as_posix() in warning
    assert warning in (tmp_path / "cmp" / "compare.md").read_text().replace("\\", "")  # markdown-escaped


def test_trials_leaves_out_what_it_cannot_rank_by_name_and_ranks_the_rest(tmp_path):
    """A folder that is no run, a run without step times and a run.json edited to facts of the wrong type ended
    trials with exit 2 (no ranking), a silent omission and an internal error; a name with an escape sequence
    reached the terminal raw. Each is now named on stderr and left out, the others ranked, exit 1."""
    sample = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"
    runs = tmp_path / "runs"
    for name in ("a\x1b[31mRED", "b", "edited"):
        shutil.copytree(sample, runs / name, ignore=shutil.ignore_patterns(".steplens"))
    shutil.copytree(sample / "comms", runs / "comms_only" / "comms")
    (runs / "notes").mkdir()
    (runs / "notes" / "todo.txt").write_text("compare these\n")
    runner = CliRunner()
    first = runner.invoke(steplens, ["trials", str(runs)])
    assert first.exit_code == 1, first.output
    manifest = runs / "edited" / ".steplens" / "run.json"
    doc = json.loads(manifest.read_text())
    doc["facts"]["train_batch_size"] = "8"
    doc["facts"]["ds_config"]["train_micro_batch_size_per_gpu"] = "four"
    manifest.write_text(json.dumps(doc))
    result = runner.invoke(steplens, ["trials", str(runs), "--format", "json"])
    assert result.exit_code == 1, result.output
    stderr = " ".join(result.stderr.split())
    assert "notes: nothing steplens reads here" in stderr and "comms_only: no step times" in stderr
    assert "edited" in stderr and "facts.train_batch_size" in stderr
    ranked = {run for c in json.loads(result.stdout)["configurations"] for run in c["runs"]}
    assert ranked == {"a\x1b[31mRED", "b"}
    text = runner.invoke(steplens, ["trials", str(runs)])
    assert "\x1b" not in text.stdout and "a?[31mRED" in text.stdout


# ---------------------------------------------------------------------------------------------
# Logs-only runs


MEGATRON_LOG = "Megatron-DeepSpeed/random_ltd_gpt3_baseline/gpt3-0.125B-tokendropping-graduallyIncrease-lr-3.0e-4-baseline.log"


def _megatron_args(text: str) -> dict[str, int]:
    block = text[text.index("-- arguments --"):text.index("-- end of arguments --")]
    values = {}
    for name in ("num_layers", "hidden_size", "num_attention_heads", "kv_channels", "ffn_hidden_size", "seq_length",
                 "global_batch_size", "world_size"):
        values[name] = int(re.search(rf"^  {name} \.+ (\d+)$", block, re.MULTILINE)[1])
    values["padded_vocab_size"] = int(re.search(r"new size: (\d+)\)", text)[1])
    return values


def test_megatron_log_gives_mfu_from_its_model_shape(corpus, tmp_path):
    """The corpus log (12 layers, hidden 768, 12 heads, seq 2048, global batch 256, padded vocab 50304,
    8 GPUs), analysed with an A100's 312 TFLOP/s: MFU per logged interval against the hand count."""
    run = tmp_path / "megatron"
    run.mkdir()
    log = run / "train.log"
    shutil.copyfile(corpus / MEGATRON_LOG, log)
    text = log.read_text()
    args = _megatron_args(text)
    assert args == {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "kv_channels": 64,
                    "ffn_hidden_size": 3072, "seq_length": 2048, "global_batch_size": 256, "world_size": 8,
                    "padded_vocab_size": 50304}
    # Per token, by hand: 6 x [12 x (768 x 2304 + 768 x 768 + 2 x 768 x 3072) + 768 x 50304] = 741,408,768
    # for the matmuls, plus 6 x 12 x 768 x 2048 = 113,246,208 for causal attention.
    per_token = 741_408_768 + 113_246_208
    flops = per_token * 256 * 2048
    result = CliRunner().invoke(analyze, [str(run), "-q", "--peak-tflops", "312"])
    assert result.exit_code in (0, 1), result.output
    import polars as pl

    rows = pl.read_parquet(run / ".steplens" / "mfu").filter(pl.col("numerator") == "megatron_args")
    logged = {int(n) - 1: float(ms) for n, ms in
              re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)", text)}
    table = pl.read_parquet(run / ".steplens" / "step_time")
    kept = table.filter(~pl.col("excluded"))
    # an evaluation after iteration N runs in the logged interval that holds step N (0-based): no training step's time
    evaluated = [int(n) for n in re.findall(r"validation loss at iteration\s+(\d+) \|", text)]
    after_evaluation = {min(s for s in logged if s >= n) for n in evaluated if any(s >= n for s in logged)}
    assert len(after_evaluation) == 4 and after_evaluation.isdisjoint(kept["step"].to_list())
    assert all("evaluation" in r for r in table.filter(pl.col("step").is_in(list(after_evaluation)))["reason"])
    assert sorted(rows["step"].to_list()) == sorted(kept["step"].to_list())
    assert len(logged) - 5 - len(after_evaluation) < rows.height <= len(logged) - len(after_evaluation)
    for step, utilization, row_flops in rows.select("step", "utilization", "flops").iter_rows():
        assert row_flops == flops
        assert utilization == pytest.approx(flops / (logged[step] / 1e3 * 8 * 312e12), rel=1e-9)
    finding = json.loads((run / ".steplens" / "findings.json").read_text())["mfu"]
    megatron = next(f for f in finding if f["numerator"] == "megatron_args")
    expected = statistics.median(flops / (logged[s] / 1e3 * 8 * 312e12) for s in kept["step"].to_list())
    assert megatron["utilization"] == pytest.approx(expected, rel=1e-9)
    assert "Megatron-LM model FLOPs" in megatron["definition"] and "312" in megatron["peak"]


def test_megatron_shape_from_the_command_line_alone(tmp_path):
    """No arguments block: the runner's command line gives the shape, with grouped-query attention,
    SwiGLU and an unpadded vocabulary. By hand: L 2, h 64, 4 heads of 16 -> d_q 64, 2 query groups ->
    d_kv 32, F_ffn 256 (x3 with SwiGLU), vocab 1000 padded to 1024, s 128, global batch 8 -> 1,024
    tokens. Per token 6 x [2 x (64 x 128 + 64 x 64 + 3 x 64 x 256) + 64 x 1024] = 1,130,496 plus
    6 x 2 x 64 x 128 = 98,304 for attention: 1,228,800; per iteration x 1,024 = 1,258,291,200."""
    run = tmp_path / "megatron_cmd"
    run.mkdir()
    stamp = "[2026-01-01 10:00:00,000] [INFO]"
    lines = [f"{stamp} [runner.py:504:main] cmd = python -u -m deepspeed.launcher.launch --world_info=e30= pretrain_gpt.py "
             "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --kv-channels 16 --group-query-attention "
             "--num-query-groups 2 --ffn-hidden-size 256 --swiglu --vocab-size 1000 --seq-length 128 "
             "--micro-batch-size 4 --global-batch-size 8 --fp16",
             f"{stamp} [launch.py:156:main] dist_world_size=2"]
    step_ms = [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]
    lines += [f" iteration {10 * (i + 1):8d}/     100 | consumed samples: {80 * (i + 1):8d} | elapsed time per iteration "
              f"(ms): {ms:.1f} | learning rate: 1.000E-04 | lm loss: 5.0E+00 |" for i, ms in enumerate(step_ms)]
    (run / "train.log").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(analyze, [str(run), "-q", "--peak-tflops", "100"])
    assert result.exit_code in (0, 1), result.output
    import polars as pl

    rows = pl.read_parquet(run / ".steplens" / "mfu").sort("step")
    assert rows["flops"].to_list() == [1_258_291_200.0] * len(step_ms) and rows["gpus"].to_list() == [2] * len(step_ms)
    assert rows["step"].to_list() == [10 * (i + 1) - 1 for i in range(len(step_ms))]
    assert rows["utilization"].to_list() == pytest.approx([1_258_291_200 / (ms / 1e3 * 2 * 100e12) for ms in step_ms])


def test_deepspeed_chat_log_gets_step_time_from_its_throughput_lines(corpus, tmp_path):
    """With the inferred batch, a logs-only DS-Chat run has a step time: batch / CurrSamplesPerSec."""
    run = tmp_path / "chat"
    run.mkdir()
    shutil.copyfile(corpus / "DeepSpeedExamples" / "deepspeed_chat_step1_sft/opt-1.3b-globalBatchSize128.log", run / "sft.log")
    result = CliRunner().invoke(analyze, [str(run), "-q"])
    assert result.exit_code in (0, 1), result.output
    rates = [float(v) for v in re.findall(r"CurrSamplesPerSec=([\d.]+)", (run / "sft.log").read_text())]
    times = [128 / rate * 1e9 for rate in rates]
    kept = times[_warm_up(times):]
    summary = json.loads((run / ".steplens" / "findings.json").read_text())["step_time"]
    assert summary["source"] == "log" and summary["steps"] == len(kept) == 736
    assert summary["median_ns"] == pytest.approx(statistics.median(kept), abs=1)


@pytest.mark.parametrize("name, batch", [
    ("deepspeed_chat_step1_sft/opt-1.3b-globalBatchSize128.log", 128),
    ("deepspeed_chat_step2_reward/opt-350m_globalBatchSize-64.log", 64),
])
def test_deepspeed_chat_logs_get_global_samples(corpus, name, batch):
    """The global batch is in the file name, not in the log: steplens infers it from samples/s x time,
    rounded to the per-device batch the command line gives."""
    path = corpus / "DeepSpeedExamples" / name
    parsed = deepspeed_log.parse(path, name)
    assert parsed.facts["train_batch_size"] == batch
    scalars = parsed.tables["scalars"]
    assert scalars["global_samples"].null_count() == 0 and scalars.height > 1000
    # Each line's optimizer steps done, read here: "step=N" and "global_step=N" (N steps done).
    text = path.read_text()
    step_lines, rate_lines = re.findall(r"\] step=(\d+),", text), re.findall(r"global_step=(\d+),", text)
    # skipped_steps and lr per step line; 2 rates and 2 memory figures per throughput line
    assert scalars.height == 2 * len(step_lines) + 4 * len(rate_lines)
    assert sorted(scalars["global_samples"].to_list()) == sorted(
        [int(n) * batch for n in step_lines] * 2 + [int(n) * batch for n in rate_lines] * 4)


def test_compare_takes_mfu_of_one_numerator_and_peak_from_both_runs(tmp_path):
    """compare states the first MFU figure both runs state with the same numerator and peak, recomputed here from
    each run's mfu table (the median over its steps); over two different peaks it compares none and says why."""
    sample = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"
    runs = {}
    for name, peak in (("a", "0.1"), ("b", "0.1"), ("c", "0.2")):
        runs[name] = tmp_path / name
        shutil.copytree(sample, runs[name], ignore=shutil.ignore_patterns(".steplens"))
        assert CliRunner().invoke(analyze, [str(runs[name]), "-q", "--peak-tflops", peak]).exit_code in (0, 1)

    def headline(run: Path) -> tuple[str, float]:
        rows = [r for r in pq.read_table(run / ".steplens" / "mfu").to_pylist()
                if r["metric"] == "MFU" and r["utilization"] is not None]
        numerator = json.loads((run / ".steplens" / "findings.json").read_text())["mfu"][0]["numerator"]
        return numerator, statistics.median(r["utilization"] for r in rows if r["numerator"] == numerator)

    same = CliRunner().invoke(steplens, ["compare", str(runs["a"]), str(runs["b"]), "--out", str(tmp_path / "ab"),
                                         "--format", "json"])
    [mfu] = [m for m in json.loads(same.stdout)["metrics"] if m["metric"].startswith("MFU")]
    numerator, value = headline(runs["a"])
    assert mfu["metric"] == f"MFU (median, {mfu_words(numerator)})"
    assert mfu["base"] == pytest.approx(value) and mfu["new"] == pytest.approx(headline(runs["b"])[1])
    apart = CliRunner().invoke(steplens, ["compare", str(runs["a"]), str(runs["c"]), "--out", str(tmp_path / "ac"),
                                          "--format", "json"])
    result = json.loads(apart.stdout)
    [mfu] = [m for m in result["metrics"] if m["metric"].startswith("MFU")]
    assert mfu["base"] is None and mfu["new"] is None
    assert any(w.startswith("MFU not compared: the runs' MFU figures share no numerator and peak") for w in result["warnings"])
    # one side without MFU (no peak: a CPU run analysed without --peak-tflops): the other side's figure still shows
    runs["d"] = tmp_path / "d"
    shutil.copytree(sample, runs["d"], ignore=shutil.ignore_patterns(".steplens"))
    assert CliRunner().invoke(analyze, [str(runs["d"]), "-q"]).exit_code in (0, 1)
    one_sided = CliRunner().invoke(steplens, ["compare", str(runs["d"]), str(runs["a"]), "--out", str(tmp_path / "da"),
                                              "--format", "json"])
    result = json.loads(one_sided.stdout)
    [mfu] = [m for m in result["metrics"] if m["metric"].startswith("MFU")]
    assert mfu["base"] is None and mfu["new"] == pytest.approx(headline(runs["a"])[1])
    assert "MFU of the new run only: the base run has none" in result["warnings"]


def mfu_words(numerator: str) -> str:
    return mfu_words_table.get(numerator, numerator)


def test_compare_never_takes_a_median_over_mfu_numerators():
    """A run with two MFU numerators (the helper's ZeRO-3 job: the analytic count 3.395%, the FLOPs profile 3.05%):
    compare printed their median, 3.2%, a figure with no definition. Hand-made findings: the analytic count is
    compared, as analyze heads with it; a run without it is compared on the FLOPs profile both state."""
    from steplens.analyze.analyses.compare import mfu_pair

    class Run:
        def __init__(self, *figures):
            self.findings = {"mfu": [{"metric": "MFU", "numerator": n, "peak": "p", "utilization": u} for n, u in figures]}

    both = Run(("palm", 0.03395), ("collector_flops_profile", 0.0305))
    other = Run(("palm", 0.033), ("collector_flops_profile", 0.031))
    assert mfu_pair(both, other) == (f"MFU (median, {mfu_words('palm')})", 0.03395, 0.033, None)
    profile_only = Run(("collector_flops_profile", 0.029))
    assert mfu_pair(both, profile_only) == (f"MFU (median, {mfu_words('collector_flops_profile')})", 0.0305, 0.029, None)
