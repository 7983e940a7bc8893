"""Memory bounded whatever the content, for every native text and JSON input (issue 37): a text input over the
reader's limit keeps its first and last whole lines (the middle counted), a csv_monitor file or FLOPs profile with
an endless line or a crash's zero bytes is read in bounded memory with its good rows kept, and a JSON input over
its limit is not parsed. Expected values are computed here from the bytes written."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from steplens.analyze.importers import bounded, deepspeed_log

PROC = Path("/proc/self/status")


def _log_lines(first: int, last: int) -> list[bytes]:
    return [f"[2026-11-29 12:59:{s % 60:02d},493] [INFO] [logging.py:123:log_dist] [Rank 0] step={s}, skipped=0, "
            f"lr=[{s}e-06], mom=[(0.9, 0.999)]\n".encode() for s in range(first, last + 1)]


def test_a_text_input_over_the_limit_keeps_its_first_and_last_whole_lines(tmp_path, monkeypatch):
    lines = _log_lines(1, 3000)
    log = tmp_path / "train.log"
    log.write_bytes(b"".join(lines))
    limit = 64 << 10
    monkeypatch.setattr(bounded, "MAX_TEXT_BYTES", limit)
    imported = deepspeed_log.parse(log, "train.log")
    # expected: the lines that end within the first half, and those that start after the last half's first byte
    half, size, offset, head, tail = limit // 2, log.stat().st_size, 0, [], []
    for step, line in enumerate(lines, start=1):
        if offset + len(line) <= half:
            head.append(step)
        if offset > size - half:
            tail.append(step)
        offset += len(line)
    lr = sorted(round(v * 1e6) for v in imported.tables["scalars"].filter(name="lr")["value"].to_list())
    assert lr == head + tail and head and tail and len(head) + len(tail) < len(lines)
    skipped = size - sum(len(lines[s - 1]) for s in head + tail)
    assert {i[1]: i[2] for i in imported.issues}["middle_skipped"] == skipped


PROBE = """
import sys, time
from pathlib import Path
from steplens.analyze.importers import telemetry

def peak_mb():  # VmHWM starts afresh at exec
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    return int(line.split()[1]) / 1024

path = Path(sys.argv[1])
importer = next(i for i in telemetry.IMPORTERS if i.name == sys.argv[2])
before = peak_mb()
imported = importer.parse(path, path.name)
rows = {name: frame.height for name, frame in imported.tables.items()}
print(peak_mb() - before, rows, {i[1]: i[2] for i in imported.issues})
"""


def _probe(path: Path, importer: str) -> tuple[float, dict, dict]:
    done = subprocess.run([sys.executable, "-c", PROBE, str(path), importer], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    grown, rest = done.stdout.split(maxsplit=1)
    rows_text, issues_text = rest.rsplit("} {", 1)
    return float(grown), ast.literal_eval(rows_text + "}"), ast.literal_eval("{" + issues_text)


@pytest.mark.skipif(not PROC.exists(), reason="reads the peak memory from /proc")
@pytest.mark.parametrize("hostile", ["long_line", "zeros"])
def test_a_csv_monitor_file_with_an_endless_line_or_a_crash_tail_keeps_its_rows_in_bounded_memory(tmp_path, hostile):
    csv = tmp_path / "Train_Samples_train_loss.csv"
    good = "step,train_loss\n" + "".join(f"{s * 8},{10 - s / 100}\n" for s in range(1, 201))
    with open(csv, "wb") as f:
        f.write(good.encode())
        if hostile == "long_line":
            f.write(b"1608," + b"9" * (300 << 20) + b"\n")
            f.write(b"1616,7.5\n")
    if hostile == "zeros":
        with open(csv, "r+b") as f:
            f.truncate(csv.stat().st_size + (1 << 30))  # a hole: reads as zeros, takes no disk
    grown_mb, rows, issues = _probe(csv, "csv_monitor")
    assert grown_mb < 150, grown_mb
    if hostile == "long_line":
        assert rows == {"scalars": 201} and issues["long_lines"] == 1 and issues["garbled_lines"] == 1
    else:
        assert rows == {"scalars": 200} and set(issues) >= {"zero_padding", "middle_skipped"}


@pytest.mark.skipif(not PROC.exists(), reason="reads the peak memory from /proc")
def test_a_json_input_over_its_limit_is_not_parsed(tmp_path):
    dump = tmp_path / "comms_dict_raw_rank0.json"
    dump.write_bytes(b'{"all_reduce": {"1024": [1, [0.5], [0.1], [0.1]]}' + b" " * 64)
    with open(dump, "r+b") as f:
        f.truncate((256 << 20) + 1)  # one byte over, as zero bytes (a hole)
    grown_mb, rows, issues = _probe(dump, "deepspeed_comms_dict")
    assert grown_mb < 50 and rows == {} and issues == {"oversized_file": 1}
    small = tmp_path / "small" / "comms_dict_raw_rank0.json"
    small.parent.mkdir()
    small.write_text(json.dumps({"all_reduce": {"1024": [1, [0.5], [0.1], [0.1]]}}))
    assert _probe(small, "deepspeed_comms_dict")[1] == {"comms_calls": 1}


def test_a_monitor_file_keeps_its_first_points_and_counts_the_rest(tmp_path, monkeypatch):
    from steplens.analyze.importers import monitor_scalars

    monkeypatch.setattr(monitor_scalars, "MAX_POINTS", 100)
    csv = tmp_path / "Train_Samples_lr.csv"
    csv.write_text("step,lr\n" + "".join(f"{8 * s},{s / 1000}\n" for s in range(1, 151)))
    imported = monitor_scalars.parse_csv_monitor(csv, csv.name)
    assert imported.tables["scalars"]["global_samples"].to_list() == [8 * s for s in range(1, 101)]
    assert [i[1:3] for i in imported.issues] == [["points_capped", 50]]


def test_a_monitor_line_with_a_negative_step_is_a_garbled_line_not_a_point(tmp_path):
    """DeepSpeed's csv_monitor writes global_samples, a count: a line at step -5 is damage, skipped and counted."""
    from steplens.analyze.importers import monitor_scalars

    csv = tmp_path / "Train_Samples_train_loss.csv"
    csv.write_text("step,train_loss\n8,2.5\n-5,2.4\n16,2.3\n")
    imported = monitor_scalars.parse_csv_monitor(csv, csv.name)
    assert imported.tables["scalars"]["global_samples"].to_list() == [8, 16]
    assert [i[1:3] for i in imported.issues] == [["garbled_lines", 1]]
    assert "lines [3]" in imported.issues[0][3]
