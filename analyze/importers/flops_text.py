"""DeepSpeed FLOPs-profiler text (`print_model_profile`, the engine's `flops_profiler.output_file`)
-> `flops_profile` rows and summary facts.

The text has a summary block ("world size: 2", "fwd MACs per GPU: 234.88 MMACs", "fwd latency:
20.76 ms", ...), an aggregated block, and the detailed tree: `print(model)` with each module's
extra_repr replaced by "params = pct% Params, MACs = pct% MACs, latency = pct% latency, FLOPS"
(older versions: commas instead of " ="). Every number went through `number_to_string`
(deepspeed/profiling/flops_profiler/profiler.py: units T/G/M/K/''/m/u, `params_to_string` B for G,
2 decimals), so values are exact only to half a unit of the last decimal: `exact` is False.

The tree gives inclusive MACs per module; own MACs = inclusive - the children's inclusive, set to 0
when within the rounding of the numbers involved. The tree prints a FLOPS rate, not a FLOP count,
so per-module flops stay null; the root's flops_total is the summary's "fwd flops per GPU".

Known profiler errors flagged here:
* When the engine starts the profiler (flops_profiler in ds_config), it starts inside the root
  module's forward pre-hook, so the root's start time stays 0 and its latency is `time.time()`
  (e.g. "1.8 Gs"): `duration_bogus` when the root latency is over 1e6 s or over 100x the summary's
  fwd latency.
* Under ZeRO-3 the profiler counts Linear MACs twice (deepspeed-artifacts.md pitfall 6): an issue
  when the run's ds_config (ds_config.json next to the file or one folder up) says stage 3.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from steplens.analyze.importers.base import Imported, conform, peek
from steplens.analyze.importers.bounded import read_text

HEADER = "-- DeepSpeed Flops Profiler --"
# number_to_string / params_to_string prefixes (profiler.py), B = 1e9 in params_to_string; params_to_string
# printed thousands as " k" in DeepSpeed 0.5-0.9.
PREFIX = {"T": 1e12, "G": 1e9, "B": 1e9, "M": 1e6, "K": 1e3, "k": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}
VALUE = re.compile(r"^\s*([-+]?\d+(?:\.\d+)?)(?:[eE]([-+]?\d{1,3}))?\s*([TGBMKkmu]?)(MACs|FLOPS|s)?\s*$")
SUMMARY_ITEM = re.compile(r"^([A-Za-z][^:]*?):\s+(\S.*?)\s*$")
STEP = re.compile(r"Profile Summary at step (\d+)")
STATS = (r"(?P<params>[\d.]+ ?[TGBMKk]?)(?: =|,) [\d.]+% Params, (?P<macs>[\d.]+ ?[TGMK]?)MACs(?: =|,) [\d.]+% MACs, "
         r"(?P<lat>[\d.]+ ?[TGMKmu]?)s(?: =|,) [\d.]+% latency, (?P<rate>[\d.]+ ?[TGMKmu]?)FLOPS")
STATS_LINE = re.compile(rf"^\s*{STATS}")
MODULE_OPEN = re.compile(r"^(?P<indent>\s*)(?:\((?P<name>[^)]+)\): )?(?:\d+ x )?(?P<cls>[A-Za-z_][\w.]*)\((?P<rest>.*)$")
LINEAR_SHAPE = re.compile(r"in_features=(\d+), out_features=(\d+)")
# Root latency above this many seconds is `time.time()` minus 0, not a forward pass.
BOGUS_ROOT_SECONDS = 1e6
BOGUS_ROOT_RATIO = 100  # root latency over this multiple of the summary's fwd latency
SUMMARY_FACTS = {  # summary label (lower case, before any " = ") -> fact key
    "world size": "world_size", "data parallel size": "data_parallel_size", "model parallel size": "model_parallel_size",
    "model paralel size": "model_parallel_size",  # DeepSpeed's own spelling until 2021
    "batch size per gpu": "batch_size_per_gpu", "params per gpu": "params_per_gpu", "fwd macs per gpu": "fwd_macs_per_gpu",
    "fwd flops per gpu": "fwd_flops_per_gpu", "fwd latency": "fwd_latency_s", "bwd latency": "bwd_latency_s",
    "step latency": "step_latency_s", "iter latency": "iter_latency_s", "samples/second": "samples_per_second",
    "fwd flops per gpu (rate)": "fwd_flops_per_second_per_gpu", "flops per gpu": "flops_per_second_per_gpu",
    # DeepSpeed 0.3's "Summary of forward pass:" (one process's forward; labels cut at " = " as above)
    "profile step": "profile_step", "number of parameters": "params_per_gpu",
    "number of multiply-accumulate operations (macs)": "fwd_macs_per_gpu",
    "number of floating point operations (": "fwd_flops_per_gpu", "latency": "fwd_latency_s",
    "floating point operations per second(flops)": "fwd_flops_per_second_per_gpu",
}
# The detailed tree's banner: "Detailed Profile per GPU" since DeepSpeed 0.4, "Detailed Profile" in 0.3.
DETAILED_BANNER = re.compile(r"-{3,} Detailed Profile(?: per GPU)? -{3,}")


INTEGER_FACTS = ("world_size", "data_parallel_size", "model_parallel_size", "batch_size_per_gpu", "profile_step")


def number(text: str) -> tuple[float, float] | None:
    """'12.58 MMACs' -> (12580000.0, 5000.0): the value and its rounding (half the last printed digit);
    '-2.9601e+08 us' (how Python prints a large float) -> (-296.01, 0.005)."""
    match = VALUE.match(text)
    if not match:
        return None
    digits, exponent, prefix = match[1], int(match[2] or 0), match[3]
    decimals = (len(digits.split(".")[1]) if "." in digits else 0) - exponent
    scale = PREFIX[prefix]
    return float(digits) * 10**exponent * scale, 0.5 * 10.0**-decimals * scale


def claims(path: Path) -> bool:
    if not path.name.endswith((".txt", ".log", ".out")):
        return False
    return HEADER in peek(path, 2048).decode("utf-8", "replace")


def ds_config_files(path: Path) -> list[Path]:
    return [p for p in (path.with_name("ds_config.json"), path.parent.parent / "ds_config.json") if p.is_file()]


def parse(path: Path, rel: str) -> Imported:
    read_issues: list = []
    try:
        text = read_text(path, read_issues)
    except OSError as e:
        return Imported(issues=[["error", "unreadable", 1, str(e)]])
    context = {}
    for config_path in ds_config_files(path):
        try:
            config = json.loads(config_path.read_text())
            stage = config.get("zero_optimization", {}).get("stage")
        except (OSError, ValueError, AttributeError, RecursionError):  # RecursionError: JSON nested too deep
            continue
        if isinstance(stage, int):
            context["zero_stage"] = stage
            break
    imported = parse_lines(text.splitlines(), rel, context)
    imported.issues.extend(read_issues)
    return imported


def parse_lines(lines: list[str], rel: str, context: dict | None = None) -> Imported:
    """One profiler printout (lines from its header on). `context` may give zero_stage."""
    context = context or {}
    issues: list = []
    if not any(HEADER in line for line in lines[:50]):
        return Imported(issues=[["error", "not_a_flops_profile", 1, f"no '{HEADER.strip('- ')}' header"]])
    facts, tree_start = _summary(lines, issues)
    rows = _tree(lines[tree_start:], issues) if tree_start is not None else []
    if tree_start is None:
        issues.append(["warning", "no_module_tree", 1, "no detailed per-module profile (detailed=false or cut off)"])
    elif rows and _unclosed(lines[tree_start:]):
        issues.append(["warning", "truncated", 1, "the module tree is cut off; the modules printed so far are kept"])
    for row in rows:
        row.update(rank=0, source=rel, profile_step=facts.get("profile_step"), exact=False)
    if rows:
        _own_macs(rows)
        root = rows[0]
        if "fwd_flops_per_gpu" in facts:
            root["flops_total"] = _rounded(facts["fwd_flops_per_gpu"])
        _flag_bogus_root(root, facts, rel, issues)
    stage = context.get("zero_stage")
    if stage is not None:
        facts["zero_stage"] = stage
    if stage == 3:
        issues.append(["warning", "zero3_double_count", 1,
                       ("ZeRO stage 3 (ds_config): DeepSpeed's profiler counts Linear MACs twice under ZeRO-3, "
                       "so its MACs, flops and FLOPS are about 2x too high")])
    # conform(..., issues): an inf or an integer beyond int64 (a 20-digit MACs count) is null, counted.
    table = {"flops_profile": conform(rows, "flops_profile", issues)} if rows else {}
    return Imported(tables=table, issues=issues, facts=facts)


def _summary(lines: list[str], issues: list) -> tuple[dict, int | None]:
    facts, in_summary = {}, True
    for i, line in enumerate(lines):
        if DETAILED_BANNER.search(line):
            return facts, i + 1
        if step := STEP.search(line):
            try:
                facts["profile_step"] = int(step[1])
            except ValueError:  # more digits than int() reads (4300)
                issues.append(["warning", "bad_fact", 1, f"profile_step: {len(step[1])} digits; left out"])
            continue
        in_summary = in_summary and "Aggregated Profile" not in line
        if not in_summary or not (item := SUMMARY_ITEM.match(line)):
            continue
        # The profiler writes counts as "flops" and rates as "FLOPS" (its Notations say so); a formula after " = "
        # is no sign of either: 2021's "fwd flops per GPU = 2 * fwd MACs per GPU" is the count,
        # "fwd FLOPS per GPU = fwd flops per GPU / fwd latency" the rate.
        head = item[1].split(" = ")[0]
        label = head.lower() + (" (rate)" if "FLOPS" in head and head.lower() == "fwd flops per gpu" else "")
        key = SUMMARY_FACTS.get(label)
        if key and key not in facts and (value := number(item[2])) and value[0] < 0:
            # A count, a latency or a rate below 0 is no measurement: DeepSpeed's profiler printed a bwd latency of
            # -2.9601e+08 us and -0.5 samples/second when the step's timers went wrong (a real Megatron-DeepSpeed log)
            issues.append(["warning", "bad_fact", 1, f"{key}: {item[2]} is below 0; left out"])
        elif key and key not in facts and (value := number(item[2])):
            try:
                facts[key] = int(value[0]) if key in INTEGER_FACTS else value[0]
            except OverflowError:  # more digits than a float holds: inf is no count
                issues.append(["warning", "bad_fact", 1, f"{key}: a number past float's range; left out"])
        elif key and key not in facts:  # "nan M", "inf", a value cut off: no measurement
            issues.append(["warning", "bad_fact", 1, f"{key}: {item[2][:40]!r} is not a number; left out"])
    return facts, None


def _tree(lines: list[str], issues: list) -> list[dict]:
    """The detailed profile: print(model) with stats; nesting by parentheses."""
    rows: list[dict] = []
    stack: list[dict] = []  # open modules
    for line in lines:
        stripped = line.strip()
        if not stripped:
            continue
        if stripped == "...":  # children left out of the printout
            if stack:
                stack[-1]["_elided"] = True
            continue
        if stripped == ")":
            if stack:
                stack.pop()
            continue
        if stripped.startswith("-----") and set(stripped) == {"-"}:
            break
        if not stack and rows:
            break  # text after the root closed
        if (stats := STATS_LINE.match(line)) and stack and stack[-1]["_stats"] is None:
            _set_stats(stack[-1], stats)
            continue
        module = MODULE_OPEN.match(line)
        if not module or (not stack and module["name"]):
            continue  # notes before the tree
        parent = stack[-1] if stack else None
        name = module["name"] or ""
        row = {"path": f"{parent['path']}.{name}" if parent and parent["path"] else name, "module_class": module["cls"],
               "depth": len(stack), "_stats": None, "_children": [], "_rounding": 0.0, "_elided": False}
        if parent is not None:
            parent["_children"].append(row)
        rows.append(row)
        rest = module["rest"]
        if inline := re.search(STATS, rest):
            _set_stats(row, inline)
        if not rest.rstrip().endswith(")") or rest.strip() == "":
            stack.append(row)
    return rows


def _set_stats(row: dict, stats: re.Match) -> None:
    params, macs, latency = number(stats["params"]), number(stats["macs"]), number(stats["lat"])
    row["_stats"] = True
    if params:
        row["params"] = _rounded(params[0])
    if macs:
        row["macs_total"], row["_rounding"] = _rounded(macs[0]), macs[1]
    if latency:
        row["duration_ns"] = _rounded(latency[0] * 1e9)


def _rounded(value: float) -> int | float:
    """round(value); inf (more digits than a float holds) stays a float, which conform stores as null and counts."""
    try:
        return round(value)
    except OverflowError:
        return value


def _unclosed(lines: list[str]) -> bool:
    depth = 0
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("-----") and set(stripped) == {"-"}:
            break
        if MODULE_OPEN.match(line) and not line.rstrip().endswith(")"):
            depth += 1
        elif stripped == ")":
            depth -= 1
    return depth > 0


def _own_macs(rows: list[dict]) -> None:
    """own = inclusive - children's inclusive; 0 when the difference is within the printed rounding;
    null when a child's numbers were left out ("(...)" or "..."). A ModuleList prints no numbers: its
    inclusive values are its children's sums."""
    for row in reversed(rows):  # children before parents
        children = row["_children"]
        if row["_elided"] or any(c.get("macs_total") is None for c in children):
            continue
        if row.get("macs_total") is None and children and row["module_class"] == "ModuleList":
            row["macs_total"] = sum(c["macs_total"] for c in children)
            row["params"] = sum(c.get("params") or 0 for c in children)
            row["_rounding"] = sum(c["_rounding"] for c in children)
        if row.get("macs_total") is None:
            continue
        own = row["macs_total"] - sum(c["macs_total"] for c in children)
        tolerance = row["_rounding"] + sum(c["_rounding"] for c in children)
        row["macs"] = 0 if abs(own) <= tolerance else own
    for row in rows:
        for key in ("_stats", "_children", "_rounding", "_elided"):
            row.pop(key, None)


def _flag_bogus_root(root: dict, facts: dict, rel: str, issues: list) -> None:
    duration_s = (root.get("duration_ns") or 0) / 1e9
    fwd = facts.get("fwd_latency_s")
    bogus = duration_s > BOGUS_ROOT_SECONDS or bool(fwd and duration_s > BOGUS_ROOT_RATIO * fwd)
    root["duration_bogus"] = bogus
    if bogus:
        instead = f"; the summary's fwd latency is {fwd:.4g} s" if fwd else ""
        issues.append(["warning", "bogus_root_latency", 1,
                       (f"root module latency {duration_s:.3g} s is time.time() minus an unset start (the engine "
                       f"starts the profiler inside the root's forward pre-hook); flagged duration_bogus{instead}")])
