"""Untrusted text (file, kernel and run names from traces and logs) made safe for a terminal.

A name in a trace can hold raw escape sequences (set the window title, clear the screen) or rich
markup (`[bold]`, `[/x]`). Printed text goes through `safe_text`; rich output is printed with
`markup=False` or through `rich.markup.escape`.
"""

from __future__ import annotations

import json
import re

# C0 and C1 control characters (ESC, BEL, CSI, ...) except tab and newline; DEL too.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Characters that reorder, hide or break text on screen: bidirectional controls and marks (U+061C, U+200E-F,
# U+202A-E, U+2066-9), zero-width and invisible characters (U+00AD soft hyphen, U+180E, U+200B-D, U+2060-4,
# U+FEFF), the line and paragraph separators U+2028-9, variation selectors (U+FE00-F, U+E0100-EF) and the tag
# characters U+E0000-7F, which carry hidden text.
_INVISIBLE = re.compile("[\u00ad\u061c\u180e\u200b-\u200f\u2028\u2029\u202a-\u202e\u2060-\u2064\u2066-\u2069"
                        "\ufe00-\ufe0f\ufeff\U000e0000-\U000e007f\U000e0100-\U000e01ef]")


def file_name_text(name: str) -> str:
    """A file name as Python reads it from the file system (bytes that are not UTF-8 kept as lone surrogates,
    which no Arrow column, JSON reader or terminal takes) with each such byte shown as U+FFFD."""
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that is no escaped byte
        raw = name.encode("utf-8", "replace")
    return raw.decode("utf-8", "replace")


def safe_text(value: object) -> str:
    """`value` as text with control and bidi-override characters replaced by `?` (one line per line)."""
    return _INVISIBLE.sub("?", _CONTROL.sub("?", str(value)))


def path_text(path: object) -> str:
    """A path for one line of output: safe_text, with a newline in a file name shown as `?` too."""
    return safe_text(path).replace("\n", "?").replace("\t", "?")


def shapes_text(shapes: object) -> str:
    """An op's `Input Dims` (JSON text such as `[[16, 48], [], [48]]`) as `16x48, -, 48`: one entry per
    argument, `-` for one that is not a tensor (or a 0-d one); anything else as it is."""
    try:
        dims = json.loads(shapes) if isinstance(shapes, str) else shapes
    except ValueError:
        return safe_text(shapes)
    if not isinstance(dims, list):
        return safe_text(shapes)

    def one(arg) -> str:
        if isinstance(arg, list) and all(isinstance(d, int) for d in arg):
            return "x".join(str(d) for d in arg) or "-"
        return safe_text(json.dumps(arg))

    return ", ".join(one(arg) for arg in dims)


def tensor_shapes_text(shapes: object) -> str:
    """Only the tensor arguments of `shapes_text` (`8x16, 16`), for a sentence: the `-` of scalars and 0-d
    tensors say nothing there."""
    text = shapes_text(shapes)
    return ", ".join(part for part in text.split(", ") if part != "-") or "no tensor inputs"


def text_value(value) -> str:
    """A value as a reader expects it: yes/no, not recorded, thousands separators; never a Python repr."""
    if value is None:
        return "not recorded"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(text_value(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}: {text_value(v)}" for k, v in value.items())
    return str(value)


def sentence(note: str) -> str:
    """A note as a sentence: a capital first letter and one full stop."""
    return note[0].upper() + note[1:] + ("" if note.endswith(".") else ".")


def number_ranges(numbers: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2, 5, 7-8'."""
    parts, start, prev = [], None, None
    for n in sorted(set(numbers)):
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = n
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(parts)


def utilization_text(value: float) -> str:
    """An MFU-like share: one decimal of a percent (9.8%), two significant digits below 0.1% (0.020%, not 0.0%)."""
    return f"{value:.1%}" if value == 0 or abs(value) >= 0.001 else f"{value * 100:.2g}%"
