"""How the importers of native artifacts (logs, csv_monitor files, FLOPs-profiler text, comms dumps, autotuning
files) read a file: with memory bounded whatever its content, every cut counted as an issue.

- Text is read a block at a time: zero bytes (what a crash or a preallocated file leaves) are left out, each line
  is cut at MAX_LINE_BYTES, and of a file over MAX_TEXT_BYTES only the first and the last half of that are read
  (the start holds a job's settings, the end how it ended), the middle counted as skipped.
- JSON documents are parsed whole (json.loads), so one over MAX_JSON_BYTES is not read at all; nor is a W&B log
  over MAX_BINARY_BYTES.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# Longest line read (a line, or a segment of a progress bar redrawn with \r): longer ones are cut here. The longest
# real lines are a ds_config or Megatron's arguments printed on one line (tens of kB); a runaway line (a tensor
# printed whole, a binary blob) would otherwise cost its size several times over, and minutes of regex scanning.
MAX_LINE_BYTES = 1 << 20
READ_BLOCK_BYTES = 4 << 20
# Largest text read whole: its bytes, decoded text and split lines cost about 6x this in memory. Real DeepSpeed and
# Megatron logs of long jobs are tens to hundreds of MB.
MAX_TEXT_BYTES = 512 << 20
# Largest JSON document parsed: json.loads holds about 5-10x its size as Python objects. DeepSpeed's comms dumps hold
# a few floats per call (tens of MB for a million calls), autotuning files a few kB.
MAX_JSON_BYTES = 256 << 20
# Largest binary log decoded whole (a W&B run-*.wandb file).
MAX_BINARY_BYTES = 512 << 20
_LINE_END = re.compile(rb"[\r\n]")


def _blocks(f, size: int, max_bytes: int, skipped: list):
    """(block, resumed) pairs: the whole file, or its first and last max_bytes / 2, each cut to whole lines
    (resumed: the first block after the middle, whose size in bytes is appended to `skipped`)."""
    if size <= max_bytes:
        while block := f.read(READ_BLOCK_BYTES):
            yield block, False
        return
    half, done = max_bytes // 2, 0
    while done < half and (block := f.read(min(READ_BLOCK_BYTES, half - done))):
        done += len(block)
        if done >= half and (end := block.rfind(b"\n")) >= 0:
            done -= len(block) - end - 1
            yield block[:end + 1], False  # the head ends with its last whole line, never half a line
            break
        yield block, False
    f.seek(size - half)
    f.readline(MAX_LINE_BYTES)  # the rest of a line whose start was skipped
    skipped.append(f.tell() - done)
    resumed = True
    while block := f.read(READ_BLOCK_BYTES):
        yield block, resumed
        resumed = False


def read_bounded(path: Path, max_bytes: int | None = None) -> tuple[bytes, list, bool]:
    """The text file's bytes as they are read (see the module's rules; max_bytes: MAX_TEXT_BYTES), the issues saying
    what was left out, and whether the file ends with a newline."""
    max_bytes = max_bytes or MAX_TEXT_BYTES
    kept, issues = [], []
    zero_bytes, cut_lines, line_bytes, cutting, last = 0, 0, 0, False, b""
    size, skipped = os.stat(path).st_size, []
    with open(path, "rb") as f:
        for block, resumed in _blocks(f, size, max_bytes, skipped):
            if resumed:  # the skipped middle ends the line that was being read
                kept.append(b"\n")
                line_bytes, cutting = 0, False
            if zeros := block.count(b"\0"):
                zero_bytes += zeros
                block = block.translate(None, b"\0")  # (replace() takes 10x as long on a run of zeros)
            last = block[-1:] or last
            start = keep_from = 0  # block[keep_from:start] is kept as it is, in one piece
            for end in [m.end() for m in _LINE_END.finditer(block)] + [len(block)]:
                ended = end > start and block[end - 1] in b"\r\n"
                body_bytes = end - start - ended
                if cutting:  # the rest of a line already cut: only its end is kept
                    kept.append(block[keep_from:start])
                    keep_from = end - ended
                elif line_bytes + body_bytes > MAX_LINE_BYTES:
                    kept.append(block[keep_from:start + MAX_LINE_BYTES - line_bytes])
                    keep_from = end - ended
                    cut_lines += 1
                    cutting = True
                line_bytes = 0 if ended else line_bytes + body_bytes
                cutting = cutting and not ended
                start = end
            kept.append(block[keep_from:])
    if zero_bytes:
        issues.append(["info", "zero_padding", zero_bytes, f"{zero_bytes} zero bytes (what a crash or a preallocated "
                                                           "file leaves) were left out"])
    if cut_lines:
        issues.append(["warning", "long_lines", cut_lines, f"{cut_lines} line(s) longer than {MAX_LINE_BYTES >> 20} MiB "
                                                          "were cut there; the rest of each was not read"])
    if skipped:
        issues.append(["warning", "middle_skipped", skipped[0], f"the file is {size / 2**20:,.0f} MiB: its first and "
                                                               f"last {max_bytes / 2**21:g} MiB were read (to whole "
                                                               f"lines), the {skipped[0]:,} bytes between them were not"])
    return b"".join(kept), issues, last == b"\n"


def read_text(path: Path, issues: list, max_bytes: int | None = None) -> str:
    """read_bounded's text, decoded (bad bytes replaced), its issues added to `issues`."""
    data, found, _ends_with_newline = read_bounded(path, max_bytes)
    issues.extend(found)
    return data.decode("utf-8", "replace")


class TooLarge(ValueError):
    """A JSON input over the size it may have (issue reason oversized_file)."""


def load_json(path: Path, max_bytes: int | None = None):
    """The parsed JSON document; TooLarge when the file is larger than max_bytes (OSError, ValueError and
    RecursionError as json raises them otherwise)."""
    size, max_bytes = os.stat(path).st_size, max_bytes or MAX_JSON_BYTES
    if size > max_bytes:
        raise TooLarge(f"{size / 2**20:,.0f} MiB, over the {max_bytes >> 20} MiB a JSON input may have; not parsed")
    return json.loads(Path(path).read_bytes())
