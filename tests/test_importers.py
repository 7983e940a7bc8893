"""The ingest side of the importers: discovery, companions, reuse, failures, empty tables."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from steplens.analyze.importers import telemetry
from steplens.analyze.pipeline import ingest
from steplens.analyze.contract import schema
from steplens.analyze.importers.base import Imported, Importer, conform


def _parse_counts(path: Path, rel: str) -> Imported:
    """A toy format: lines `name,samples,value`; a sibling `rank.txt` says the rank."""
    rank = int((path.parent / "rank.txt").read_text())
    rows = []
    for line in path.read_text().splitlines():
        name, samples, value = line.split(",")
        rows.append({"rank": rank, "source": rel, "origin": "toy", "name": name,
                     "global_samples": int(samples), "value": float(value)})
    return Imported(tables={"scalars": conform(rows, "scalars")}, facts={"world_size": 4})


TOY = Importer(name="toy", claims=lambda p: p.suffix == ".toy", parse=_parse_counts,
               companions=lambda p: [p.parent / "rank.txt"])


@pytest.fixture
def toy_registry(monkeypatch):
    monkeypatch.setattr(telemetry, "IMPORTERS", [TOY])


def _run(tmp_path: Path, rank: int = 2) -> Path:
    run = tmp_path / "run"
    (run / "a").mkdir(parents=True)
    (run / "a" / "loss.toy").write_text("train/loss,8,2.5\ntrain/loss,16,2.25\n")
    (run / "a" / "rank.txt").write_text(str(rank))
    (run / "notes.md").write_text("not data")
    return run


def test_importer_rows_land_in_their_table(tmp_path, toy_registry):
    run = _run(tmp_path)
    result = ingest.ingest(run, jobs=1)
    scalars = pl.read_parquet(result.out_dir / "scalars")
    assert scalars.select("rank", "global_samples", "value").rows() == [(2, 8, 2.5), (2, 16, 2.25)]
    manifest = json.loads((result.out_dir / "run.json").read_text())
    (toy,) = [s for s in manifest["sources"] if s["kind"] == "toy"]
    assert toy["companions"] == ["a/rank.txt"] and toy["tables"] == ["scalars"]
    assert manifest["ranks"] == [2] and manifest["trace_ranks"] == [] and manifest["world_size"] == 4
    assert manifest["ignored_files"] == ["notes.md"]  # the companion is not listed as unknown
    for table in schema.TELEMETRY_TABLES:  # empty tables exist, so SQL over them works
        assert pl.read_parquet(result.out_dir / table).columns == schema.TABLES[table][0].names


def test_a_changed_companion_means_parsing_again(tmp_path, toy_registry):
    run = _run(tmp_path)
    assert ingest.ingest(run, jobs=1).parsed == 1
    assert ingest.ingest(run, jobs=1).reused == 1
    (run / "a" / "rank.txt").write_text("3")
    result = ingest.ingest(run, jobs=1)
    assert result.parsed == 1 and pl.read_parquet(result.out_dir / "scalars")["rank"].unique().to_list() == [3]


@pytest.mark.parametrize("failure", [ValueError, pl.exceptions.PanicException])  # a Rust panic is a BaseException
def test_a_failing_importer_costs_its_file_only(tmp_path, monkeypatch, failure):
    def broken(path, rel):
        raise failure("bad line 3")

    monkeypatch.setattr(telemetry, "IMPORTERS", [Importer("broken", lambda p: p.name == "x.toy", broken), TOY])
    run = _run(tmp_path)
    (run / "x.toy").write_text("junk")
    result = ingest.ingest(run, jobs=1)
    (failed,) = result.failed
    assert failed.path == "x.toy" and "bad line 3" in failed.issues[0][3]
    assert pl.read_parquet(result.out_dir / "scalars").height == 2


def test_conform_stores_values_a_column_cannot_hold_as_null_and_counts_them():
    """A row value beyond int64, text in a number column, a float in an int column (never truncated) or a
    lone surrogate once made pl.DataFrame raise, and the importer lost its whole file."""
    rows = [{"rank": 0, "name": "loss", "value": 1.5, "step": 1},
            {"rank": 2**70, "name": "lr\udcff", "value": 10**400, "step": "7"},
            {"rank": 1, "name": "loss", "value": 2, "step": 2.5},
            {"rank": 2**63 - 1, "name": "loss", "value": float("inf"), "step": -(2**63)}]
    issues = []
    frame = conform(rows, "scalars", issues)
    assert frame.select("rank", "name", "value", "step").rows() == [
        (0, "loss", 1.5, 1), (None, None, None, None), (1, "loss", 2.0, None), (2**63 - 1, "loss", float("inf"), -(2**63))]
    assert sorted((reason, count, detail.split(":")[0]) for _, reason, count, detail in issues) == [
        ("unrepresentable_value", 1, "scalars.name"), ("unrepresentable_value", 1, "scalars.rank"),
        ("unrepresentable_value", 1, "scalars.value"), ("unrepresentable_value", 2, "scalars.step")]
    assert frame.schema == conform([], "scalars").schema
    with pytest.raises(ValueError, match="scalars.rank"):  # no list to count them in: not silently nulled
        conform(rows, "scalars")
