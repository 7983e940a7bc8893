"""FLOPs-profiler text importer against the exact integers of the direct API in the same run
(api_results.json), within the text's rounding, and on the BERT-large A100 output of DeepSpeed's docs."""

import json
import math
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze.importers import flops_text
from steplens.analyze.importers import telemetry

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
RUNS = SHARED / "deepspeed-cpu-runs"
BERT = SHARED / "corpus/DeepSpeed/docs_examples/flops_profiler_output_bert-large_A100.txt"


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not found")
    return path


def _rounding(exact: float) -> float:
    """Half a unit of the last printed digit: number_to_string prints 2 decimals of a 1e3-power unit."""
    if exact < 1:
        return 0.005
    return 0.005 * 10 ** (3 * math.floor(math.log10(exact) / 3))


def test_number_parsing():
    assert flops_text.number("12.58 MMACs") == pytest.approx((12.58e6, 0.005e6))
    assert flops_text.number("888.35 us")[0] == pytest.approx(888.35e-6)
    assert flops_text.number("932.61 K")[0] == pytest.approx(932610)
    assert flops_text.number("1.3 B")[0] == pytest.approx(1.3e9)  # params_to_string writes B for G
    assert flops_text.number("260 mFLOPS")[0] == pytest.approx(0.26)
    assert flops_text.number("0 MACs") == (0.0, 0.5)
    assert flops_text.number("1.8 Gs")[0] == pytest.approx(1.8e9)
    assert flops_text.number("n/a") is None


@pytest.mark.parametrize("run", ["run1", "run2", "run5", "run3"])
def test_modules_match_the_direct_api_within_rounding(run):
    folder = _need(RUNS / run / "flops_profiler")
    api = {m["name"].replace("<root>", ""): m for m in json.loads((folder / "api_results.json").read_text())["per_module"]}
    path = folder / "api_print_model_profile.txt"
    imported = flops_text.parse(path, path.name)
    rows = {r["path"]: r for r in imported.tables["flops_profile"].iter_rows(named=True)}
    assert set(rows) == set(api)
    for name, exact in api.items():
        row = rows[name]
        assert row["depth"] == exact["depth"] and row["module_class"] == exact["class"]
        children = [m for n, m in api.items() if name and n.startswith(f"{name}.") and n.count(".") == name.count(".") + 1]
        # A ModuleList prints no numbers: its values are sums of its children's rounded ones.
        summed = exact["class"] == "ModuleList"
        params_tolerance = sum(_rounding(c["params"]) for c in children) if summed else _rounding(exact["params"])
        macs_tolerance = sum(_rounding(c["macs_incl_children"]) for c in children) if summed else 0
        assert row["params"] == pytest.approx(exact["params"], abs=params_tolerance)
        assert row["macs_total"] == pytest.approx(
            exact["macs_incl_children"], abs=macs_tolerance or _rounding(exact["macs_incl_children"]))
        tolerance = _rounding(exact["macs_incl_children"]) + sum(_rounding(c["macs_incl_children"]) for c in children)
        assert row["macs"] == pytest.approx(exact["own_macs"], abs=tolerance)
        assert row["exact"] is False
    facts = imported.facts
    totals = json.loads((folder / "api_results.json").read_text())["values"]
    assert facts["fwd_macs_per_gpu"] == pytest.approx(totals["get_total_macs()"], abs=_rounding(totals["get_total_macs()"]))
    assert facts["fwd_flops_per_gpu"] == pytest.approx(totals["get_total_flops()"], abs=_rounding(totals["get_total_flops()"]))
    assert rows[""]["duration_bogus"] is False  # the direct API started before the forward


def test_engine_profile_root_latency_is_flagged():
    path = _need(RUNS / "run1/flops_profiler/flops_profile.txt")
    imported = flops_text.parse(path, path.name)
    root = imported.tables["flops_profile"].filter(pl.col("depth") == 0).row(0, named=True)
    assert root["duration_bogus"] is True and root["duration_ns"] == 1.8e18  # "1.8 Gs"
    exact = json.loads((RUNS / "run1/flops_profiler/api_results.json").read_text())["values"]["get_total_macs()"]
    assert root["macs_total"] == pytest.approx(exact, abs=_rounding(exact))  # same model and batch, ZeRO-2
    assert [i for i in imported.issues if i[1] == "bogus_root_latency"]
    # Summary block (flops_profile.txt lines 10-27) as printed.
    facts = imported.facts
    assert (facts["profile_step"], facts["world_size"], facts["batch_size_per_gpu"]) == (4, 2, 4)
    assert facts["fwd_latency_s"] == pytest.approx(0.03398)
    assert facts["samples_per_second"] == 71.44
    assert facts["zero_stage"] == 2
    assert not [i for i in imported.issues if i[1] == "zero3_double_count"]


def test_zero3_double_count_flagged():
    path = _need(RUNS / "run3/flops_profiler/flops_profile.txt")
    imported = flops_text.parse(path, path.name)
    assert imported.facts["zero_stage"] == 3
    assert [i for i in imported.issues if i[1] == "zero3_double_count"]
    zero2 = json.loads((RUNS / "run1/flops_profiler/api_results.json").read_text())["values"]
    # What the flag is about: the same model and batch under ZeRO-2 (run1) has about half the MACs.
    assert imported.facts["fwd_macs_per_gpu"] / zero2["get_total_macs()"] == pytest.approx(2, rel=0.05)


def test_bert_large_docs_output():
    path = _need(BERT)
    assert telemetry.claimant(path).name == "deepspeed_flops_profile"
    imported = flops_text.parse(path, path.name)
    rows = {r["path"]: r for r in imported.tables["flops_profile"].iter_rows(named=True)}
    assert imported.facts["profile_step"] == 10 and imported.facts["batch_size_per_gpu"] == 80
    assert rows[""]["macs_total"] == 3139.93e9 and rows[""]["params"] == 336.23e6
    assert rows[""]["duration_bogus"] is False  # 76.39 ms against a 76.67 ms fwd latency
    query = rows["bert.encoder.layer.0.attention.self.query"]
    assert (query["module_class"], query["depth"], query["macs_total"]) == ("Linear", 7, 10.74e9)
    assert query["macs"] == query["macs_total"]
    assert rows["bert.embeddings"]["macs_total"] is None  # printed as "(...)"
    assert rows[""]["macs"] is None and rows["bert.encoder.layer"]["macs"] is None  # children left out
    assert rows["bert.encoder.layer.0.attention.self"]["macs"] is None  # its dropout and softmax are "(...)"
    assert rows["bert.encoder.layer.0.intermediate"]["macs"] == 0  # all of it is in its one printed child


def test_cut_and_bad_inputs(tmp_path):
    engine_crash = _need(RUNS / "run1/flops_profiler/api_print_model_profile_with_engine.txt")
    imported = flops_text.parse(engine_crash, engine_crash.name)  # ZeroDivisionError mid-summary
    assert imported.tables == {} and imported.facts["fwd_macs_per_gpu"] == 234.88e6
    assert [i for i in imported.issues if i[1] == "no_module_tree"]

    whole = (RUNS / "run1/flops_profiler/flops_profile.txt").read_text().splitlines(keepends=True)
    tree_start = next(i for i, line in enumerate(whole) if line.startswith("TinyGPT("))
    cut = tmp_path / "cut.txt"
    cut.write_text("".join(whole[: tree_start + 12]))
    imported = flops_text.parse(cut, cut.name)
    assert imported.tables["flops_profile"].height == 10  # TinyGPT, tok, pos, blocks, blocks.0 and 5 of its layers
    assert [i for i in imported.issues if i[1] == "truncated"]

    for name, data in (("empty.txt", b""), ("junk.txt", bytes(range(256)) * 8)):
        bad = tmp_path / name
        bad.write_bytes(data)
        assert not flops_text.claims(bad)
        assert flops_text.parse(bad, name).issues[0][:2] == ["error", "not_a_flops_profile"]


def _damaged_profile(tmp_path, replacements: dict[str, str], ds_config: str | None = None):
    """run1's engine profile with text replaced (each once), in a run folder whose ds_config.json is `ds_config`
    (else run1's); and the profile as written."""
    original = _need(RUNS / "run1/flops_profiler/flops_profile.txt")
    text = original.read_text()
    for old, new in replacements.items():
        assert old in text
        text = text.replace(old, new, 1)
    path = tmp_path / "flops_profiler" / "flops_profile.txt"
    path.parent.mkdir()
    path.write_text(text)
    (tmp_path / "ds_config.json").write_text(ds_config or (RUNS / "run1/ds_config.json").read_text())
    return flops_text.parse(path, path.name), flops_text.parse(original, path.name)


def test_numbers_past_float_range_are_left_out_and_counted(tmp_path):
    huge = "9" * 400  # float() reads it as inf
    damaged, whole = _damaged_profile(tmp_path, {
        "world size:                                                             2": f"world size: {huge}",
        "fwd flops per GPU:                                                      471.76 M": f"fwd flops per GPU: {huge} M",
        "(qkv): Linear(49.54 K = 5.31% Params": f"(qkv): Linear({huge} K = 5.31% Params"})  # blocks.0.qkv
    rows, expected = damaged.tables["flops_profile"], whole.tables["flops_profile"]
    assert rows.filter(pl.col("path") == "blocks.0.qkv")["params"].to_list() == [None]
    assert rows.filter(pl.col("depth") == 0)["flops_total"].to_list() == [None]
    unchanged = ~pl.col("path").is_in(["blocks.0.qkv", ""])
    assert rows.filter(unchanged).equals(expected.filter(unchanged))
    assert rows.drop("params", "flops_total").equals(expected.drop("params", "flops_total"))
    assert "world_size" not in damaged.facts and damaged.facts["fwd_flops_per_gpu"] == float("inf")
    assert {k: v for k, v in damaged.facts.items() if k not in ("world_size", "fwd_flops_per_gpu")} == {
        k: v for k, v in whole.facts.items() if k not in ("world_size", "fwd_flops_per_gpu")}
    counted = sorted((reason, count, detail.split(":")[0]) for _, reason, count, detail in damaged.issues
                     if reason in ("bad_fact", "unrepresentable_value"))
    assert counted == [("bad_fact", 1, "world_size"), ("unrepresentable_value", 1, "flops_profile.flops_total"),
                       ("unrepresentable_value", 1, "flops_profile.params")]


def test_a_summary_value_that_is_no_number_is_left_out_and_counted(tmp_path):
    """'nan M' or a value cut to its unit is no measurement: left out of the facts, with the key named."""
    damaged, whole = _damaged_profile(tmp_path, {
        "fwd flops per GPU:                                                      471.76 M": "fwd flops per GPU: nan M",
        "world size:                                                             2": "world size: two"})
    assert "fwd_flops_per_gpu" in whole.facts and "world_size" in whole.facts
    assert "fwd_flops_per_gpu" not in damaged.facts and "world_size" not in damaged.facts
    assert {k: v for k, v in damaged.facts.items()} == {
        k: v for k, v in whole.facts.items() if k not in ("world_size", "fwd_flops_per_gpu")}
    assert sorted(i[3] for i in damaged.issues if i[1] == "bad_fact") == [
        "fwd_flops_per_gpu: 'nan M' is not a number; left out", "world_size: 'two' is not a number; left out"]


def test_profile_step_past_the_int_digit_limit_is_left_out(tmp_path):
    damaged, whole = _damaged_profile(tmp_path, {"Profile Summary at step 4:": f"Profile Summary at step {'4' * 5000}:"})
    assert "profile_step" not in damaged.facts and whole.facts["profile_step"] == 4
    assert damaged.tables["flops_profile"]["profile_step"].null_count() == damaged.tables["flops_profile"].height
    assert damaged.tables["flops_profile"].drop("profile_step").equals(whole.tables["flops_profile"].drop("profile_step"))
    assert [(i[1], i[2], i[3].split(":")[0]) for i in damaged.issues if i[1] == "bad_fact"] == [
        ("bad_fact", 1, "profile_step")]


def test_ds_config_nested_too_deep_is_not_read(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    damaged, whole = _damaged_profile(tmp_path, {}, ds_config=f'{{"zero_optimization": {{"stage": 2}}, "a": {deep}}}')
    assert whole.facts["zero_stage"] == 2 and "zero_stage" not in damaged.facts
    assert damaged.tables["flops_profile"].equals(whole.tables["flops_profile"])


# The summary as DeepSpeed printed it in May 2021 (its flops_profiler README at 4544b7d2f): the FLOPs count's line
# carries a formula too, and "parallel" is misspelt.
SUMMARY_2021 = """-------------------------- DeepSpeed Flops Profiler --------------------------
Profile Summary at step 10:
world size:                                                   1
data parallel size:                                           1
model paralel size:                                           1
batch size per GPU:                                           80
params per gpu:                                               336.23 M
fwd MACs per GPU:                                             3139.93 G
fwd flops per GPU = 2 * fwd MACs per GPU:                     6279.86 G
fwd flops of model = fwd flops per GPU * mp_size:             6279.86 G
fwd latency:                                                  76.67 ms
fwd FLOPS per GPU = fwd flops per GPU / fwd latency:          81.9 TFLOPS
"""


def test_a_flops_count_is_never_taken_for_a_rate_whatever_formula_its_line_prints():
    facts = flops_text.parse_lines(SUMMARY_2021.splitlines(), "flops.txt").facts
    assert facts["fwd_flops_per_gpu"] == 6279.86e9  # the count: "flops", whatever follows " = "
    assert facts["fwd_flops_per_second_per_gpu"] == 81.9e12  # the rate: "FLOPS"
    assert facts["model_parallel_size"] == 1 and facts["fwd_latency_s"] == pytest.approx(0.07667)
    current = flops_text.parse(_need(BERT), BERT.name).facts  # today's form: the count's line has no formula
    assert (current["fwd_flops_per_gpu"], current["fwd_flops_per_second_per_gpu"]) == (6279.86e9, 81.9e12)


def test_a_negative_latency_or_rate_is_left_out_with_an_issue():
    """The summary of a profiled step whose timers went wrong (a real Megatron-DeepSpeed run, 2024)."""
    lines = SUMMARY_2021.replace("fwd latency:                                                  76.67 ms",
                                 "bwd latency:                                                  -2.9601e+08 us\n"
                                 "samples/second:                                               -0.5").splitlines()
    imported = flops_text.parse_lines(lines, "flops.txt")
    assert "bwd_latency_s" not in imported.facts and "samples_per_second" not in imported.facts
    assert sorted(detail for _, reason, _, detail in imported.issues if reason == "bad_fact") == [
        "bwd_latency_s: -2.9601e+08 us is below 0; left out", "samples_per_second: -0.5 is below 0; left out"]
    assert imported.facts["fwd_flops_per_gpu"] == 6279.86e9  # the rest of the summary stands


# DeepSpeed 0.5-0.9 printed params in thousands as " k" (params_to_string); the layout of the FLOPs
# profiler tutorial's Megatron GPT-2 output, cut to one layer.
TREE_2021 = """-------------------------- DeepSpeed Flops Profiler --------------------------
Profile Summary at step 10:
world size:                                                   1
params per gpu:                                               1.29 M

------------------------------ Detailed Profile per GPU ------------------------------
GPT2Model(
  1.29 M, 100.00% Params, 41271.95 GMACs, 100.00% MACs, 1.84 s, 100.00% latency, 44.78 TFLOPS,
  (0): ParallelTransformerLayerPart1(
    49.15 k, 3.80% Params, 1099.65 GMACs, 2.66% MACs, 23.5 ms, 1.27% latency, 93.6 TFLOPS,
    (input_layernorm): FusedLayerNorm(16.38 k, 1.27% Params, 0 MACs, 0.00% MACs, 128.75 us, 0.01% latency, 0.0 FLOPS, torch.Size([8192]), eps=1e-05, elementwise_affine=True)
    (query_key_value): ColumnParallelLinear(24.58 k, 1.90% Params, 824.63 GMACs, 2.00% MACs, 8.93 ms, 0.48% latency, 184.7 TFLOPS, )
    (attention_dropout): Dropout(0, 0.00% Params, 0 MACs, 0.00% MACs, 79.63 us, 0.00% latency, 0.0 FLOPS, p=0.1, inplace=False)
  )
)
------------------------------------------------------------------------------
"""


def test_params_printed_in_lowercase_thousands_are_read():
    rows = {r["path"]: r for r in flops_text.parse_lines(TREE_2021.splitlines(), "flops.txt").tables["flops_profile"].to_dicts()}
    expected = {"": (1_290_000, 41_271_950_000_000, 1_840_000_000), "0": (49_150, 1_099_650_000_000, 23_500_000),
                "0.input_layernorm": (16_380, 0, 128_750), "0.query_key_value": (24_580, 824_630_000_000, 8_930_000),
                "0.attention_dropout": (0, 0, 79_630)}
    assert {path: (r["params"], r["macs_total"], r["duration_ns"]) for path, r in rows.items()} == expected
    assert flops_text.number("16.38 k") == pytest.approx((16380.0, 5.0))


# DeepSpeed 0.3's layout: "Summary of forward pass:" with its own labels, the tree under "Detailed Profile".
PROFILE_2020 = """-------------------------- DeepSpeed Flops Profiler --------------------------
Summary of forward pass:
Profile step:                   3
Number of parameters:           12.5 k
Number of multiply-accumulate operations (MACs):   20.0 M
Number of floating point operations ( = 2 * MACs):   40.0 M
Latency:                        4.0 ms
Floating point operations per second(FLOPS):   10.0 GFLOPS

------------------------------ Detailed Profile ------------------------------
Net(
  12.5 k, 100.00% Params, 20.0 MMACs, 100.00% MACs, 4.0 ms, 100.00% latency, 10.0 GFLOPS,
  (fc): Linear(12.5 k, 100.00% Params, 20.0 MMACs, 100.00% MACs, 3.0 ms, 75.00% latency, 13.33 GFLOPS, in_features=100, out_features=125, bias=False)
)
"""


def test_the_2020_layout_is_read():
    imported = flops_text.parse_lines(PROFILE_2020.splitlines(), "flops_profile.txt")
    assert imported.facts == pytest.approx({"profile_step": 3, "params_per_gpu": 12_500, "fwd_macs_per_gpu": 20e6,
                                            "fwd_flops_per_gpu": 40e6, "fwd_latency_s": 0.004,
                                            "fwd_flops_per_second_per_gpu": 10e9})
    assert type(imported.facts["profile_step"]) is int and not imported.issues
    rows = imported.tables["flops_profile"].select("path", "params", "macs_total", "duration_ns", "profile_step").rows()
    assert rows == [("", 12_500, 20_000_000, 4_000_000, 3), ("fc", 12_500, 20_000_000, 3_000_000, 3)]


def _summary_value(text: str, label: str) -> float:
    """A summary line's number as DeepSpeed printed it ("471.76 M" -> 471.76e6), read here with a regex of its own."""
    import re

    number, unit = re.search(rf"^{re.escape(label)}:\s+([\d.]+) ?([KMGT]?)", text, re.M).groups()
    return float(number) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[unit]


def _native_copy(tmp_path: Path, name: str) -> Path:
    """A copy of a real CPU DeepSpeed run's native artifacts (no collector)."""
    import shutil

    run = tmp_path / name
    shutil.copytree(_need(RUNS / name), run)
    return run


def test_mfu_from_deepspeed_s_own_flops_profile(tmp_path):
    """A native run whose only FLOPs count is DeepSpeed's flops_profiler output: MFU = 3 x its 'fwd flops per GPU' x
    gradient accumulation x data-parallel ranks (ds_config and the summary, read here) over each kept step's time x
    GPUs x the given peak."""
    from steplens.analyze.pipeline import analyse

    run = _native_copy(tmp_path, "run5")
    text = (run / "flops_profiler" / "flops_profile.txt").read_text()
    config = json.loads((run / "ds_config.json").read_text())
    expected = 3 * _summary_value(text, "fwd flops per GPU") * config["gradient_accumulation_steps"] * \
        _summary_value(text, "data parallel size") * _summary_value(text, "model parallel size")
    from steplens.analyze.analyses.runner import Options

    _, findings = analyse(run, tmp_path / "out", Options(peak_tflops=1.0), jobs=1)
    mfu = pl.read_parquet(tmp_path / "out" / "mfu" / "*.parquet").filter(pl.col("numerator") == "deepspeed_flops_profile")
    assert mfu.height > 0 and (mfu["flops"] == expected).all()
    assert mfu["utilization"].to_list() == pytest.approx(
        [expected / (ns * 1e-9 * 2 * 1e12) for ns in mfu["step_time_ns"].to_list()], rel=1e-12)
    assert findings["mfu"][0]["numerator"] == "deepspeed_flops_profile"


def test_no_mfu_from_deepspeed_s_profile_under_zero3(tmp_path):
    """ZeRO-3 doubles the profiler's Linear counts and its rounded per-module numbers cannot show it exactly."""
    from steplens.analyze.analyses.runner import Options
    from steplens.analyze.pipeline import analyse

    run = _native_copy(tmp_path, "run3")
    _, findings = analyse(run, tmp_path / "out", Options(peak_tflops=1.0), jobs=1)
    numerators = [row["numerator"] for row in findings["mfu"]] if isinstance(findings["mfu"], list) else []
    assert "deepspeed_flops_profile" not in numerators
    refused = findings.get("mfu_refused") or findings["mfu"].get("note", "")
    assert "ZeRO-3" in refused and "DeepSpeed's FLOPs profile" in refused


def test_profiles_of_different_forwards_give_no_mfu(tmp_path):
    """Two of DeepSpeed's profiles in one run that disagree (the API can profile any model or batch): neither is
    taken, and the message names both."""
    from steplens.analyze.analyses.runner import Options
    from steplens.analyze.pipeline import analyse

    run = _native_copy(tmp_path, "run5")
    api = run / "flops_profiler" / "api_print_model_profile.txt"
    api.write_text(api.read_text().replace("fwd flops per GPU:                                                      471.76 M",
                                           "fwd flops per GPU:                                                      943.52 M"))
    _, findings = analyse(run, tmp_path / "out", Options(peak_tflops=1.0), jobs=1)
    numerators = [row["numerator"] for row in findings["mfu"]] if isinstance(findings["mfu"], list) else []
    assert "deepspeed_flops_profile" not in numerators
    refused = findings.get("mfu_refused") or findings["mfu"].get("note", "")
    assert "disagree" in refused and "471,760,000" in refused and "943,520,000" in refused


@pytest.mark.parametrize("facts, why", [
    ({"train_micro_batch_size_per_gpu": 8, "batch_size_per_gpu": 4}, "counts a batch of 4 per GPU and the run trains 8"),
    ({"data_parallel_size": 2, "model_parallel_size": 2}, "not its 2 data-parallel x 2 model-parallel ranks"),
])
def test_a_profile_of_another_batch_or_layout_gives_no_mfu(facts, why):
    """A profile of 4 samples per GPU in a run training 8, or of a 2 x 2 layout in 8 processes (pipeline stages: each
    GPU's forward one stage's share): refused, saying why."""
    from steplens.analyze.analyses import mfu

    profile = pl.DataFrame({"source": ["flops_profile.txt"], "depth": [0], "flops_total": [471_760_000]})
    flops, problem = mfu._deepspeed_profile_flops(profile, facts, world_size=8)
    assert flops is None and why in problem
    layout = {"data_parallel_size": 4, "model_parallel_size": 2, "gradient_accumulation_steps": 2}
    assert mfu._deepspeed_profile_flops(profile, layout, world_size=8) == (3 * 471_760_000 * 2 * 4 * 2, "")
