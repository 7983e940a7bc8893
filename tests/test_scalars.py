"""Scalar importers on the real DeepSpeed monitor outputs in ../shared and on fresh W&B offline runs."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from steplens.analyze.importers import telemetry
from steplens.analyze.importers import monitor_scalars

IMPORTER = {importer.name: importer for importer in telemetry.IMPORTERS}

RUNS = Path(__file__).resolve().parents[1].parent / "shared" / "deepspeed-cpu-runs"


def run_dir(name: str) -> Path:
    path = RUNS / name
    if not path.is_dir():
        pytest.skip(f"shared DeepSpeed runs not found at {RUNS}")
    return path


def import_all(importer, files: list[Path], base: Path) -> pl.DataFrame:
    frames = [importer.parse(f, str(f.relative_to(base))).tables.get("scalars") for f in files]
    return pl.concat([f for f in frames if f is not None])


def test_csv_points_equal_tensorboard_points_in_run1():
    """Two independent artifacts of one run (csv_monitor and TensorBoard) hold the same points."""
    base = run_dir("run1")
    csv_files = sorted((base / "csv_monitor").rglob("*.csv"))
    assert csv_files and all(IMPORTER["csv_monitor"].claims(f) for f in csv_files)
    csv = import_all(IMPORTER["csv_monitor"], csv_files, base)
    tb = import_all(IMPORTER["tensorboard"], sorted((base / "tensorboard").rglob("events.out.tfevents.*")), base)
    joined = csv.join(tb, on=["name", "global_samples"], how="full", suffix="_tb")
    assert joined.height == csv.height == tb.height  # same (tag, step) pairs on both sides, no strays
    # TensorBoard's simple_value is a float32; the CSV holds the float64 DeepSpeed printed.
    for value, value_tb in joined.select("value", "value_tb").iter_rows():
        assert float(np.float32(value)) == value_tb
    assert tb["wall_ns"].is_not_null().all() and csv["wall_ns"].is_null().all()


@pytest.mark.parametrize("name", ["run1", "run2", "run3", "run5"])
def test_csv_step_is_global_samples(name):
    """DeepSpeed's monitor step is train_batch_size x optimizer step: 8, 16, ... (16, 32, ... with gas 2)."""
    base = run_dir(name)
    command = (base / "COMMAND.txt").read_text()
    world_size = int(re.search(r"--num_gpus (\d+)", command)[1])
    steps = int(re.search(r"--steps (\d+)", command)[1])
    config = json.loads((base / "ds_config.json").read_text())
    batch = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * world_size
    frame = import_all(IMPORTER["csv_monitor"], sorted((base / "csv_monitor").rglob("*.csv")), base)
    lr = frame.filter(pl.col("name") == "Train/Samples/lr")
    assert lr["global_samples"].to_list() == [batch * k for k in range(1, steps + 1)]
    assert set(frame["rank"]) == {0} and set(frame["origin"]) == {"csv_monitor"}


def test_csv_tag_names():
    assert monitor_scalars.csv_tag("Train_Samples_lr", "lr") == "Train/Samples/lr"
    assert monitor_scalars.csv_tag("Train_Samples_elapsed_time_ms_step", "elapsed_time_ms_step") == \
        "Train/Samples/elapsed_time_ms_step"
    assert monitor_scalars.csv_tag("weird", "other") == "weird"


def test_csv_repeated_header_keeps_both_segments(tmp_path):
    path = tmp_path / "Train_Samples_train_loss.csv"
    path.write_text("step,train_loss\n8,2.5\n16,2.25\n24,nan\n"
                    "step,train_loss\n16,2.3\n24,inf\n32,2.0\n")
    result = monitor_scalars.parse_csv_monitor(path, path.name)
    frame = result.tables["scalars"]
    assert frame["name"].unique().to_list() == ["Train/Samples/train_loss"]
    assert frame["segment"].to_list() == [0, 0, 0, 1, 1, 1]
    assert frame["global_samples"].to_list() == [8, 16, 24, 16, 24, 32]
    values = frame["value"].to_list()
    assert math.isnan(values[2]) and values[4] == math.inf
    [issue] = result.issues
    assert issue[:3] == ["warning", "csv_restart", 1] and path.name in issue[3]


def test_csv_garbled_lines_are_reported_and_skipped(tmp_path):
    path = tmp_path / "Train_Samples_lr.csv"
    path.write_bytes(b"step,lr\n8,0.1\n16,0.2,24,0.3\n\xff\xfe\x00junk\n32,0.4\n")
    result = monitor_scalars.parse_csv_monitor(path, path.name)
    assert result.tables["scalars"]["global_samples"].to_list() == [8, 32]
    [issue] = [i for i in result.issues if i[1] == "garbled_lines"]
    assert issue[0] == "error" and issue[2] == 2 and "lines [3, 4]" in issue[3] and path.name in issue[3]
    assert [i[1:3] for i in result.issues if i[1] != "garbled_lines"] == [["zero_padding", 1]]  # the \x00, counted


def test_csv_step_beyond_int64_is_a_garbled_line(tmp_path):
    path = tmp_path / "Train_Samples_lr.csv"
    path.write_text("step,lr\n8,0.5\n" + "9" * 30 + ",0.25\n16,0.125\n")
    result = monitor_scalars.parse_csv_monitor(path, path.name)
    frame = result.tables["scalars"]
    assert frame["global_samples"].to_list() == [8, 16] and frame["value"].to_list() == [0.5, 0.125]
    [issue] = result.issues
    assert issue[:3] == ["error", "garbled_lines", 1] and "lines [3]" in issue[3]


def test_csv_claims_only_step_headers(tmp_path):
    (tmp_path / "a.csv").write_text("step,lr\n8,0.1\n")
    (tmp_path / "b.csv").write_text("epoch,acc,loss\n1,2,3\n")
    (tmp_path / "c.csv").write_text("")
    assert [IMPORTER["csv_monitor"].claims(tmp_path / n) for n in ("a.csv", "b.csv", "c.csv")] == [True, False, False]


def test_every_tensorboard_point_is_read(tmp_path):
    """More points than TensorBoard's default 10,000-point reservoir sample for monitor_scalars."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    points = 10_050
    writer = EventFileWriter(str(tmp_path))
    for k in range(1, points + 1):
        value = summary_pb2.Summary.Value(tag="Train/Samples/lr", simple_value=k / 4)  # exact in float32
        writer.add_event(event_pb2.Event(wall_time=1.7e9 + k, step=8 * k, summary=summary_pb2.Summary(value=[value])))
    writer.close()
    [path] = tmp_path.glob("events.out.tfevents.*")
    result = monitor_scalars.parse_tensorboard(path, path.name)
    frame = result.tables["scalars"]
    assert result.issues == [] and frame.height == points
    assert frame["global_samples"].to_list() == [8 * k for k in range(1, points + 1)]
    assert frame["value"].to_list() == [k / 4 for k in range(1, points + 1)]


def test_truncated_event_file_keeps_complete_records(tmp_path):
    base = run_dir("run1")
    [original] = sorted((base / "tensorboard").rglob("events.out.tfevents.*"))
    full = monitor_scalars.parse_tensorboard(original, original.name)
    assert full.issues == []
    cut = tmp_path / original.name
    cut.write_bytes(original.read_bytes()[:-10])  # into the last record
    result = monitor_scalars.parse_tensorboard(cut, "tensorboard/" + cut.name)
    kept, expected = result.tables["scalars"], full.tables["scalars"]
    last_step = expected["global_samples"].max()
    # The last record (one point of the last step) is lost, everything before it is kept.
    assert kept.height == expected.height - 1
    assert kept.drop("source").equals(expected.head(kept.height).drop("source"))
    assert kept.filter(pl.col("global_samples") < last_step).height == \
        expected.filter(pl.col("global_samples") < last_step).height
    [issue] = result.issues
    assert issue[:2] == ["error", "truncated_event_file"] and "tensorboard/" + cut.name in issue[3]


def test_event_file_of_junk_is_an_error_not_a_crash(tmp_path):
    junk = tmp_path / "events.out.tfevents.123.host.1.0"
    junk.write_bytes(os.urandom(3000))
    result = monitor_scalars.parse_tensorboard(junk, junk.name)
    assert "scalars" not in result.tables
    assert result.issues[0][:2] == ["error", "truncated_event_file"] and junk.name in result.issues[0][3]


def test_tensorboard_damaged_points_cost_only_themselves(tmp_path):
    """A wall time of NaN or inf (no wall_ns) and scalar summaries whose tensor is not one number (skipped)."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    from tensorboard.util import tensor_util

    scalar = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
                                         data_class=summary_pb2.DATA_CLASS_SCALAR)

    def point(wall_time, step, **value):
        return event_pb2.Event(wall_time=wall_time, step=step,
                               summary=summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="lr", **value)]))

    def tensor(array):
        return {"tensor": tensor_util.make_tensor_proto(array), "metadata": scalar}

    writer = EventFileWriter(str(tmp_path))
    for event in (point(1.7e9 + 1, 8, simple_value=0.5), point(math.nan, 16, simple_value=0.25),
                  point(math.inf, 24, simple_value=0.125), point(1.7e9 + 4, 32, **tensor(np.array([1.0, 2.0]))),
                  point(1.7e9 + 5, 40, **tensor(np.array(b"text"))), point(1.7e9 + 6, 48, simple_value=0.0625)):
        writer.add_event(event)
    writer.close()
    [path] = tmp_path.glob("events.out.tfevents.*")
    result = monitor_scalars.parse_tensorboard(path, path.name)
    frame = result.tables["scalars"]
    assert frame["global_samples"].to_list() == [8, 16, 24, 48]
    assert frame["value"].to_list() == [0.5, 0.25, 0.125, 0.0625]
    assert frame["wall_ns"].to_list() == [1_700_000_001_000_000_000, None, None, 1_700_000_006_000_000_000]
    [issue] = result.issues
    assert issue[:3] == ["warning", "bad_monitor_point", 4] and path.name in issue[3]
    assert "2 point(s): the wall time" in issue[3] and "2 point(s): the value" in issue[3]


def test_an_event_record_that_does_not_decode_is_skipped(tmp_path):
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    def point(step, value):
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag="lr", simple_value=value)])
        return event_pb2.Event(wall_time=1.7e9, step=step, summary=summary).SerializeToString()

    path = tmp_path / "events.out.tfevents.1.host"
    with open(path, "wb") as f:
        writer = RecordWriter(f)
        for record in (point(8, 0.5), b"\xff\xff\xff\xff", point(16, 0.25)):  # a well-framed record of junk between
            writer.write(record)
        writer.flush()
    result = monitor_scalars.parse_tensorboard(path, path.name)
    assert result.tables["scalars"].select("global_samples", "value").rows() == [(8, 0.5), (16, 0.25)]
    [issue] = result.issues
    assert issue[:3] == ["error", "truncated_event_file", 1] and path.name in issue[3]


# --- W&B offline runs, made fresh with the real wandb client ------------------------------------

WANDB_SCRIPT = """
import math, sys, wandb
steps, batch = int(sys.argv[1]), 16
run = wandb.init(project="steplens-test", config={"train_batch_size": batch, "zero_stage": 2})
for k in range(1, steps + 1):
    loss = math.nan if k == 7 else (math.inf if k == 9 else 10.0 / k)
    run.log({"Train/Samples/train_loss": loss, "Train/Samples/lr": 1e-4 * k, "note": "text"}, step=batch * k)
run.finish()
"""


def make_wandb_run(folder: Path, steps: int) -> Path:
    pytest.importorskip("wandb")
    if shutil.which("git"):  # wandb records the commit of the repository it runs in
        subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
                       cwd=folder, check=True)
    script = folder / "log.py"
    script.write_text(WANDB_SCRIPT)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(folder), "WANDB_SILENT": "true"}
    subprocess.run([sys.executable, str(script), str(steps)], env=env, check=True, timeout=300, cwd=folder)
    [path] = folder.glob("wandb/offline-run-*/run-*.wandb")
    return path


def expected_loss(k: int) -> float:
    return math.nan if k == 7 else (math.inf if k == 9 else 10.0 / k)


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory) -> Path:
    # Enough rows that records cross the 32 KiB blocks of the LevelDB log.
    return make_wandb_run(tmp_path_factory.mktemp("wandb"), steps=1500)


def test_wandb_history_matches_what_was_logged(wandb_run):
    assert wandb_run.stat().st_size > 4 * monitor_scalars.LOG_BLOCK
    assert IMPORTER["wandb"].claims(wandb_run)
    result = monitor_scalars.parse_wandb(wandb_run, wandb_run.name)
    frame = result.tables["scalars"]
    loss = frame.filter(pl.col("name") == "Train/Samples/train_loss").sort("global_samples")
    assert loss["global_samples"].to_list() == [16 * k for k in range(1, 1501)]
    for k, value in enumerate(loss["value"].to_list(), start=1):
        assert value == expected_loss(k) or (math.isnan(value) and k == 7)
    lr = frame.filter(pl.col("name") == "Train/Samples/lr").sort("global_samples")
    assert lr["value"].to_list() == [1e-4 * k for k in range(1, 1501)]
    assert set(frame["name"]) == {"Train/Samples/train_loss", "Train/Samples/lr"}  # _step etc. are axes
    assert frame["wall_ns"].is_not_null().all()
    assert result.facts["wandb"]["config"] == {"train_batch_size": 16, "zero_stage": 2}
    if shutil.which("git"):
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=wandb_run.parents[2], capture_output=True, text=True,
                              check=True)
        assert result.facts["wandb"]["git_commit"] == head.stdout.strip()
    assert [i[1] for i in result.issues] == ["non_numeric_history"]


def test_wandb_truncated_log_keeps_complete_records(wandb_run, tmp_path):
    full = monitor_scalars.parse_wandb(wandb_run, wandb_run.name).tables["scalars"]
    cut = tmp_path / wandb_run.name
    cut.write_bytes(wandb_run.read_bytes()[: 2 * monitor_scalars.LOG_BLOCK + 1000])
    result = monitor_scalars.parse_wandb(cut, cut.name)
    kept = result.tables["scalars"]
    assert 0 < kept.height < full.height
    assert kept.equals(full.head(kept.height))
    assert any(i[:2] == ["error", "truncated_wandb_log"] and cut.name in i[3] for i in result.issues)


def test_wandb_corrupt_chunk_skips_to_next_block(wandb_run, tmp_path):
    data = bytearray(wandb_run.read_bytes())
    data[monitor_scalars.LOG_BLOCK + 100] ^= 0xFF  # inside the second block
    bad = tmp_path / wandb_run.name
    bad.write_bytes(bytes(data))
    records, problems = monitor_scalars.wandb_records(bytes(data))
    good, _ = monitor_scalars.wandb_records(wandb_run.read_bytes())
    assert len(problems) == 1 and "corrupt chunk" in problems[0]
    lost = set(good) - set(records)  # records carry a running number, so they are distinct
    assert lost and sum(map(len, lost)) < 2 * monitor_scalars.LOG_BLOCK  # the damaged block (and a record spanning it)
    assert records[-100:] == good[-100:]  # reading resumed after it
    assert monitor_scalars.parse_wandb(bad, bad.name).tables["scalars"].height > 0


def test_wandb_junk_file_is_an_error(tmp_path):
    junk = tmp_path / "run-abc.wandb"
    junk.write_bytes(b"not a wandb file" * 10)
    result = monitor_scalars.parse_wandb(junk, junk.name)
    assert result.tables == {} and result.issues[0][:2] == ["error", "not_a_wandb_log"]
    assert junk.name in result.issues[0][3]


def _varint(n: int) -> bytes:
    out = b""
    while n >= 0x80:
        out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
    return out + bytes([n])


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def history_record(**items: str) -> bytes:
    """A wandb Record holding one history row: {key: value_json} (field numbers: monitor_scalars)."""
    row = b"".join(_field(monitor_scalars.HISTORY_ITEM, _field(monitor_scalars.ITEM_KEY, key.encode())
                          + _field(monitor_scalars.ITEM_VALUE_JSON, value.encode())) for key, value in items.items())
    return _field(monitor_scalars.RECORD_HISTORY, row)


def wandb_log(records: list[bytes]) -> bytes:
    """A .wandb file of FULL chunks in one block (LevelDB log format, as monitor_scalars reads it)."""
    data = monitor_scalars.WANDB_HEADER.pack(monitor_scalars.WANDB_MAGIC, monitor_scalars.WANDB_HEADER_MAGIC, 0)
    for record in records:
        kind = bytes([monitor_scalars.LOG_FULL])
        data += monitor_scalars.LOG_CHUNK_HEADER.pack(zlib.crc32(kind + record), len(record), kind[0]) + record
    assert len(data) < monitor_scalars.LOG_BLOCK
    return data


def test_wandb_damaged_points_cost_only_themselves(tmp_path):
    path = tmp_path / "run-damaged.wandb"
    path.write_bytes(wandb_log([
        history_record(_step="16", _timestamp="1700000000.5", loss="2.5"),
        history_record(_step="32", _timestamp="1e300", loss="2.25"),  # no wall time
        history_record(_step="48", _timestamp="1700000002", loss="9" * 401, lr="0.1"),  # loss beyond float64
        history_record(_step='"x"', _timestamp="1700000003", loss="2.0"),  # no step
        history_record(_step="64", deep="[" * 5000 + "]" * 5000),  # nested past the JSON decoder's depth
        _varint(monitor_scalars.RECORD_HISTORY << 3) + _varint(5),  # a number where the history message belongs
    ]))
    result = monitor_scalars.parse_wandb(path, path.name)
    rows = result.tables["scalars"].select("name", "global_samples", "value", "wall_ns").rows()
    assert rows == [("loss", 16, 2.5, 1_700_000_000_500_000_000), ("loss", 32, 2.25, None),
                    ("lr", 48, 0.1, 1_700_000_002_000_000_000)]
    assert [issue[:3] for issue in result.issues] == [["error", "bad_wandb_record", 1], ["info", "non_numeric_history", 1],
                                                      ["warning", "bad_monitor_point", 3]]
    detail = result.issues[2][3]
    assert path.name in detail and all(f"1 point(s): the {what}" in detail for what in ("value", "step", "wall time"))


def test_wandb_reader_agrees_with_wandb_protobuf(wandb_run):
    """Our wire-format decoding against wandb's own generated protobuf classes, record by record."""
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    records, problems = monitor_scalars.wandb_records(wandb_run.read_bytes())
    assert problems == []
    history = 0
    for raw in records:
        record = wandb_internal_pb2.Record.FromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        history += 1
        ours = monitor_scalars._history_rows(dict(monitor_scalars.proto_fields(raw))[monitor_scalars.RECORD_HISTORY], "x", set(),
                                             damaged := Counter())
        assert not damaged
        theirs = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
        numeric = {k: v for k, v in theirs.items() if not k.startswith("_") and isinstance(v, (int, float))}
        assert {row["name"]: row["value"] for row in ours} == pytest.approx(numeric, nan_ok=True)
        assert {row["global_samples"] for row in ours} == {theirs["_step"]}
    assert history == 1500
