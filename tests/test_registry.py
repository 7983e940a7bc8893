"""The analysis registry: order by inputs, one producer per table, outputs cast to their declaration,
and a new analysis reaching findings.json, its table and every renderer with one registration."""

import json
import re
import shutil
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
from click.testing import CliRunner

from steplens.analyze.analyses import registry, runner
from steplens.analyze.analyses.registry import Analysis, Output
from steplens.analyze.cli import analyze
from steplens.analyze.contract import schema

SAMPLE = Path(__file__).resolve().parents[1] / "sample_runs" / "deepspeed_cpu_2rank"
STEP_COUNT = schema.table_spec(("rank", pa.int64(), "Rank."), ("steps", pa.int64(), "Collector steps of the rank."))


def _analysis(name, reads=(), writes=None, per_rank=False, passes=()):
    return Analysis(name, name, tuple(reads), writes or {}, lambda inputs: Output(), per_rank=per_rank, passes=passes)


def test_order_follows_inputs_and_per_rank_comes_first():
    late = _analysis("late", reads=("b",))
    middle = _analysis("middle", reads=("a",), writes={"b": STEP_COUNT})
    first = _analysis("first", reads=("trace_events",), passes=("a",), per_rank=True)
    assert [a.name for a in registry.ordered([late, middle, first])] == ["first", "middle", "late"]


def test_a_table_has_one_producer_and_inputs_must_exist():
    with pytest.raises(ValueError, match="produced by both"):
        registry.ordered([_analysis("x", writes={"t": STEP_COUNT}), _analysis("y", writes={"t": STEP_COUNT})])
    with pytest.raises(ValueError, match="never produced before"):
        registry.ordered([_analysis("x", reads=("t",), passes=("u",)), _analysis("y", reads=("u",), passes=("t",))])
    with pytest.raises(ValueError, match="ingested tables"):
        _analysis("x", writes={"trace_events": STEP_COUNT})


def test_outputs_are_cast_to_the_declaration():
    frame = registry.conformed(pl.DataFrame({"steps": [3], "rank": [1], "extra": ["x"]}, schema_overrides={"rank": pl.UInt32}),
                               STEP_COUNT, "t")
    assert frame.columns == ["rank", "steps"] and frame.schema["rank"] == pl.Int64
    assert registry.conformed(pl.DataFrame(), STEP_COUNT, "t").schema == {"rank": pl.Int64, "steps": pl.Int64}
    with pytest.raises(KeyError, match="lacks columns"):
        registry.conformed(pl.DataFrame({"rank": [1]}), STEP_COUNT, "t")


def test_a_registered_analysis_reaches_findings_table_and_renderers(tmp_path, monkeypatch):
    """One declaration: the runner writes its table typed, findings.json keeps its finding, and the
    terminal, summary.md and report.html show its sentence."""
    def count_steps(inputs):
        steps = inputs.table("train_steps")
        table = steps.group_by("rank").len("steps").sort("rank")
        return Output(tables={"collector_steps": table}, finding={"ranks": table.height, "steps": table["steps"].sum()})

    probe = Analysis("collector_step_count", "Collector step count", ("train_steps",), {"collector_steps": STEP_COUNT},
                     count_steps, phrase=lambda f, _: [f"Probe: {f['steps']} collector steps over {f['ranks']} ranks."],
                     section=lambda page, run: page.declared(probe, run))
    registered = runner.ANALYSES + [probe]  # the one list the runner, the verdict and the report read
    for module in ("steplens.analyze.analyses.runner", "steplens.reports.verdict", "steplens.reports.html"):
        monkeypatch.setattr(f"{module}.ANALYSES", registered)
    run = tmp_path / "run"
    shutil.copytree(SAMPLE, run, ignore=shutil.ignore_patterns(".steplens"))
    result = CliRunner().invoke(analyze, [str(run), "-q"])
    assert result.exit_code == 0, result.output
    out = run / ".steplens"
    # independent answer: the collector's own train_steps parts, read straight from the run folder
    raw = pl.read_parquet(sorted((run / "collector" / "train_steps").glob("rank*.parquet")), include_file_paths="file")
    expected = raw.with_columns(rank=pl.col("file").str.extract(r"rank(\d+)-", 1).cast(pl.Int64)).group_by("rank").len()
    table = pl.read_parquet(out / "collector_steps")
    assert table.schema == {"rank": pl.Int64, "steps": pl.Int64}
    assert table.sort("rank").rows() == expected.sort("rank").rows()
    finding = json.loads((out / "findings.json").read_text())["collector_step_count"]
    sentence = f"Probe: {expected['len'].sum()} collector steps over {expected.height} ranks."
    assert finding == {"ranks": expected.height, "steps": expected["len"].sum()}
    assert sentence in " ".join(result.output.split())
    assert sentence in (out / "summary.md").read_text().replace("\\", "")
    html = (out / "report.html").read_text()
    assert 'id="collector-step-count"' in html and sentence in html


# Keys findings.json holds that no analysis makes: the run's device (the runner) and the CLI's timings.
RUN_KEYS = {"device", "analysis_seconds", "report_seconds"}


@pytest.mark.parametrize("sample", ["synthetic_8rank", "deepspeed_cpu_2rank"])
def test_finding_keys_name_the_analysis_that_made_them_and_the_former_keys_repeat_them(tmp_path, sample):
    """Every findings.json key is an analysis's name or `<name>_<qualifier>`, a key of the run, or one of the keys
    steplens 0.1 wrote, which holds the same value as the finding that replaced it."""
    from steplens.analyze.analyses import ANALYSES

    run = tmp_path / sample
    shutil.copytree(SAMPLE.parent / sample, run, ignore=shutil.ignore_patterns(".steplens"))
    result = CliRunner().invoke(analyze, [str(run), "-q"])
    assert result.exit_code == 0, result.output
    findings = json.loads((run / ".steplens" / "findings.json").read_text())
    names = {a.name for a in ANALYSES}
    former = {old: (a.name, inner) for a in ANALYSES for old, inner in a.former_keys.items()}
    for key, value in findings.items():
        if key in RUN_KEYS or key in names or any(key.startswith(f"{name}_") for name in names):
            continue
        assert key in former, f"findings.json key {key!r} names no analysis"
        name, inner = former[key]
        assert value == (findings[name] if inner is None else findings[name][inner]), key
    # each analysis table is written by the analysis of its declaration; the gpu_idle analysis writes gpu_idle
    assert "gpu_idle" in next(a for a in ANALYSES if a.name == "gpu_idle").writes


def test_no_other_test_reads_the_former_findings_keys():
    """The keys steplens 0.1 wrote go in 0.3: the tests read each finding under its analysis's name; only the test
    above, which checks that the former keys still repeat it, reads them."""
    from steplens.analyze.analyses import ANALYSES

    former = sorted({old for analysis in ANALYSES for old in analysis.former_keys})
    assert former  # the keys to look for come from the registry, not from this test
    keys = "|".join(map(re.escape, former))
    # findings["stragglers"], findings.get("stragglers", f["stragglers"], in either quote
    read = re.compile(rf"""\b(?:findings\[|findings\.get\(|f\[)\s*(["'])(?:{keys})\1""")
    tests = Path(__file__).resolve().parent
    found = [f"{path.relative_to(tests)}:{number}: {line.strip()}"
             for path in sorted([*tests.glob("*.py"), *(tests / "gpu").glob("*.py")]) if path.name != "test_registry.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if read.search(line)]
    assert not found, "tests reading findings by a former key:\n" + "\n".join(found)
