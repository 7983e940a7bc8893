"""DeepSpeed (and Megatron-DeepSpeed) job logs -> step_timers, scalars, comms_calls, comms_summary,
run_status, plus launcher/config facts.

One file may hold one rank (`--enable_each_rank_log`, torchrun's per-rank stdout), every rank
interleaved (the launcher's stdout), or several jobs appended to one file (`run_spans`; `parse(...,
run_index=k)` reads run k alone, and analyze/pipeline/runs.split_appended_logs makes each its own run). Lines are read one by one
with regexes; anything unrecognised is skipped, so garbled interleaved writes cost only themselves.

Runs. A new run starts at the DeepSpeed runner's `cmd = ...` line, at a second launcher
`WORLD INFO DICT` line, at a second launcher-less start (`mpi_discovery] Discovered MPI settings
of world_rank=0`), or at a script's own `cmd = ...` echo after records (DeepSpeed-Chat's logs), each
numbered `run_index` from 0. Per-run state (step counters, comms running
totals) restarts with each run.

Ranks. `[Rank N]` in the line (log_dist), else `[rankN]:` (PyTorch), else `rank<N>` in the file
name, else 0: the lines without a rank prefix that are read here (throughput, log_summary tables)
are printed by rank 0 only in DeepSpeed. Megatron's iteration line is printed by the last rank:
world_size - 1 when the launcher header gave the world size, else null.

Steps. `step` is the 0-based optimizer step everywhere, as in `train_steps`:
* wall-clock timers (`[Rank r] time (ms) | name: ms | ...`, printed with print, always present
  with wall_clock_breakdown): every line before and including a rank's global-timer line (fwd, bwd,
  step, ...) belongs to the current step; the global line closes it. This matches DeepSpeed's order
  per accumulation boundary (engine.py `_take_model_step` then `step()`): the optimizer line, the
  micro line, the global line; with gas > 1 a micro line is printed at every micro step.
* `step=N, skipped=S, lr=[...]` (engine `_report_progress(global_steps + 1)`) and the throughput
  line `epoch=E/micro_step=M/global_step=N, RunningAvgSamplesPerSec=...` are printed when N
  optimizer steps are done: step = N - 1 (null for the `step=0` line printed at initialisation),
  global_samples = N x train_batch_size (the monitors' x axis), when the config dump gave
  train_batch_size.
* Megatron-DeepSpeed `iteration N/ M | consumed samples: ... | ...`: step = N - 1,
  global_samples / global_tokens = its consumed samples / tokens.
* the pipeline engine's `steps: N loss: L ... iter time (s): T samples/sec: S`: step = N - 1.

Comms. Verbose comms-logger lines (`comm op: <record> | time (ms): ... | msg size: ...`, rank 0,
log_level info) become comms_calls; on DeepSpeed >= 0.18.3 the times are running totals per record
name (see comms_dump), detected per run and rank (every record name non-decreasing in line order)
and repaired to per-call latencies. Message sizes are DeepSpeed's rounded text ("3.56 MB").
Log lines carry local time without a zone; ts_ns reads it as UTC. `step` of a comms call is left
null: nothing in the line ties it to a step (init-time broadcasts look like any other call).

Checkpoints. A save (DeepSpeed's "[Torch] Checkpoint global_stepN is about to be saved!" and "Saving model
checkpoint: .../global_stepN/...", Megatron's "saving checkpoint at iteration N") adds N, the optimizer steps
done when it began (the 0-based step that follows it), to the run fact `checkpoint_steps`. A custom tag
without global_stepN places no step.

Evaluations. Megatron's "validation loss at iteration N" adds N (the 0-based step that follows the evaluation,
whose logged interval holds its time) to the run fact `evaluation_steps`.

Last lines. Per rank, its last line in the file (number, text, its time stamp when it has one, and the
latest stamp of the rank's lines up to it) goes to the run fact `log_last_line_rank<r>`: which rank fell
silent first when a job hangs or dies.

Status. One run_status row per run with evidence (launcher lines, exits, a signal, a traceback):
killed (the launcher got SIGTERM/SIGINT, or a rank's return code is -N), failed (a nonzero return
code, or a traceback without every process exiting 0), completed (every local process exited 0),
incomplete (launched, no exit record), unknown (started without the launcher, no exit record).

A FLOPs profile printed into the log (no output_file) is read with `flops_text`.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import polars as pl

from steplens.analyze.contract.bus_bandwidth import with_bandwidth
from steplens.analyze.contract import schema
from steplens.analyze.contract.schema import rank_in_name, rank_in_name_issue
from steplens.analyze.importers import comms_dump, flops_text
from steplens.analyze.importers.bounded import read_bounded
from steplens.analyze.importers.base import Imported, conform

PEEK_BYTES = 64 << 10
# How far into a file `claims` looks for a first record: a job's preamble (a `set -x` trace, an environment
# dump, NCCL's INFO lines) can run for hundreds of kB before DeepSpeed's or Megatron's first line (a real
# Megatron-DeepSpeed log: 246 kB). Files that hold none are read this far, a MiB at a time.
SNIFF_LIMIT_BYTES = 16 << 20
SNIFF_BLOCK_BYTES = 1 << 20
MAX_CARRIED_CHARS = 64 << 10
SUFFIXES = (".log", ".txt", ".out")

NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"
TIMESTAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]")
LOG_STAMP = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\]")
# DeepSpeed logger format (deepspeed/utils/logging.py): "[time] [LEVEL] [file.py:line:func] msg".
LOGGER_LINE = re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\] \[(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\] \[[\w.]+:\d+:\w+\]")
RANK_PREFIX = re.compile(r"\[Rank (-?\d+)\]")
TORCH_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")

# deepspeed/utils/timer.py SynchronizedWallClockTimer.log: "[Rank 0] time (ms) | name: 1.23 | name: 4.56"; before
# 0.9 "[Rank 0] rank=0 time (ms) | ...", and in 0.3 (print, not the logger) "rank=0 time (ms) | ...".
TIMER_LINE = re.compile(r"(?:\[Rank (-?\d+)\] (?:rank=-?\d+ )?|(?<![\w\]=])rank=(-?\d+) )time \(ms\) \| (.*)$")
TIMER_ITEM = re.compile(rf"^\s*([\w.\-/]+): ({NUM})\s*$")
# Megatron's Timers.log in training_log: "time (ms) | forward-compute: 340.72 | ...", with no rank prefix,
# after the interval's iteration line, each timer normalised by the logging interval: a mean per iteration.
MEGATRON_TIMER_LINE = re.compile(r"^\s*time \(ms\) \| (.*)$")
# deepspeed/runtime/engine.py EngineTimers: global timers (one line per optimizer step).
GLOBAL_TIMERS = {"fwd", "bwd", "bwd_inner", "bwd_allreduce", "step",
                 "forward", "backward", "backward_inner", "backward_allreduce"}  # names before 0.9
# ZeRO 1/2/3 and fp16 optimizer timers (runtime/zero/stage_1_and_2.py, stage3.py, fp16/fused_optimizer.py).
OPTIMIZER_TIMERS = {"overflow_check", "compute_norm", "unscale_and_clip", "basic_step", "update_fp16",
                    "init_optimizer_state"}

STEP_LINE = re.compile(r"\[Rank (-?\d+)\] step=(\d+), skipped=(\d+), lr=\[([^\]]*)\]")
# Older DeepSpeed releases printed the same running average (ThroughputTimer.avg_samples_per_sec) as
# "<epoch>/<micro_step>, SamplesPerSec=<avg>", some with the memory figures after it.
THROUGHPUT_LINE = re.compile(
    rf"(?:epoch=\d+/micro_step=\d+/global_step=(\d+)|\b\d+/(\d+)), (?:RunningAvgSamplesPerSec=({NUM}), "
    rf"CurrSamplesPerSec=({NUM})|SamplesPerSec=({NUM}))(?:, MemAllocated=({NUM})GB, MaxMemAllocated=({NUM})GB)?")
# runtime/pipe/engine.py train_batch, printed by global rank 0 every steps_per_print steps: "steps: N loss: L
# [other losses: v ...] iter time (s): T samples/sec: S", T the mean over the steps since the last print.
PIPELINE_LINE = re.compile(rf"(?:^|\s)steps: (\d+) loss: ({NUM}) (?:.*? )?iter time \(s\): ({NUM}) samples/sec: ({NUM})")
# runtime/utils.py see_memory_usage: the message line, then "MA x GB Max_MA x GB CA x GB Max_CA x GB", each
# bytes / (1024 * 1024 * 1024) rounded to 2 decimals (Max_CA to a whole number); printed on rank 0 only.
SIZE = r"\d{1,12}(?:\.\d{1,20})?"  # a memory figure as printed (no sign, exponent or nan)
SEE_MEMORY_USAGE = re.compile(rf"\bMA ({SIZE}) GB\s+Max_MA ({SIZE}) GB\s+CA ({SIZE}) GB\s+Max_CA ({SIZE}) GB")
SEE_MEMORY_MESSAGE = re.compile(r"\[[\w.]+:\d+:see_memory_usage\] (.*?)\s*$")
GIB = 1024**3
SEE_MEMORY_RESOLUTION_BYTES = round(0.01 * GIB)
# Megatron's report_memory (megatron/utils.py): torch.cuda figures / (1024 * 1024), printed once after the first
# logged iterations by data-parallel rank 0 of each model-parallel group.
MEGATRON_MEMORY = re.compile(rf"\[Rank (\d+)\] (\(after (\d+) iterations\)) memory \(MB\) \| allocated: ({SIZE}) \| "
                             rf"max allocated: ({SIZE}) \| reserved: ({SIZE}) \| max reserved: ({SIZE})")
MIB = 1024**2
MEGATRON_ITERATION = re.compile(r"(?m)^\s*iteration\s+\d+/\s*\d+ \|.*elapsed time per iteration")
MEGATRON_LINE = re.compile(r"^\s*iteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
MEGATRON_ITEM = re.compile(rf"^\s*([A-Za-z][\w \-/()]*?)\s*:\s*({NUM})\s*$")
# DeepSpeed 0.7-0.11 wrote two spaces before "| busbw": the separators are any spacing around "|".
COMM_LINE = re.compile(
    rf"comm op: (.+?)\s*\|\s*time \(ms\):\s*({NUM})\s*\|\s*msg size:\s*([^|]+?)\s*\|\s*algbw \(Gbps\):\s*({NUM})\s*\|\s*"
    rf"busbw \(Gbps\):\s*({NUM})")
SUMMARY_HEADER = re.compile(r"^Comm\. Op\s+Message Size\s+Count\s+Total Latency\(ms\)\s+Avg Latency\(ms\)")
SUMMARY_ROW = re.compile(rf"^\s+(\d+(?:\.\d+)? ?[KMGTP]?B)\s+(\d+)\s+({NUM})\s+({NUM})\s+({NUM})\s+({NUM})\s*$")
SUMMARY_OP = re.compile(r"^([A-Za-z_][\w]*(?: \| \[Caller Func: .*\])?)\s*$")

RUNNER_CMD = re.compile(r"\[runner\.py:\d+:main\] cmd = ")
WORLD_INFO = re.compile(r"\[launch\.py:\d+:main\] WORLD INFO DICT: (\{.*\})")
MPI_RANK0 = re.compile(r"mpi_discovery\] Discovered MPI settings of world_rank=0, .*world_size=(\d+)")
DS_ACCELERATOR = re.compile(r"\[real_accelerator\.py:\d+:\w+\] Setting ds_accelerator to (\w+)")
DIST_WORLD_SIZE = re.compile(r"\[launch\.py:\d+:main\] dist_world_size=(\d+)")
NUM_LOCAL_PROCS = re.compile(r"num_local_procs=(\d+)")
NCCL_VERSION = re.compile(r"NCCL_VERSION=(\S+)")
DS_VERSION = re.compile(r"DeepSpeed info: version=([\w.+\-]+)")
# ds_report: "torch version .................... 1.11.0+cu113" (only whole, well-formed lines).
REPORT_VERSION = re.compile(r"^(torch|deepspeed|nvcc|torch cuda|transformers) (?:version|info) \.{3,} (\d+\.\d+[\w.+\-]*)(?:,|\s*$)")
# ds_report rows (deepspeed/env_report.py): "<key> ....... <value>", one per line.
REPORT_KEY = re.compile(r"torch install path|torch version|torch cuda version|torch hip version|nvcc version"
                        r"|deepspeed install path|deepspeed info|deepspeed wheel compiled w\.")
REPORT_ROW = re.compile(rf"^(?:{REPORT_KEY.pattern}) \.{{3,}} \S")
CONFIG_ITEM = re.compile(r"\[config\.py:\d+:print\]\s+(\w+) \.+ (.*)$")
CONFIG_JSON_START = re.compile(r"\[config\.py:\d+:print_user_config\]\s+json = (\{.*)$")
EXIT_OK = re.compile(r"\[launch\.py:\d+:main\] Process (\d+) exits successfully")
EXIT_CODE = re.compile(r"exits with return code = (-?\d+)")
LAUNCHED_LOCAL_RANK = re.compile(r"--local_rank=(\d+)")  # the launcher's command of the process that exited
# DeepSpeed's --enable_each_rank_log files ({timestamp}_rank{N}.log): a rank that crashed before any logger line
# (DeepSpeed's default log level) leaves its traceback alone there
EACH_RANK_LOG = re.compile(r"_rank\d+\.log$")
KILLED = re.compile(r"(?:Main process )?received (SIG\w+)")
TRACEBACK = "Traceback (most recent call last):"
EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Fault))(?::.*)?$")
FLOPS_HEADER = "-- DeepSpeed Flops Profiler --"
# Checkpoint saves: DeepSpeed's torch checkpoint engine (runtime/checkpoint_engine/torch_checkpoint_engine.py
# create(): "[Torch] Checkpoint {tag} is about to be saved!"), the engine's "Saving model checkpoint: {path}"
# (engine.py _save_checkpoint; the path holds the tag), Megatron's "saving checkpoint at iteration N to ...".
# The default tag is global_step{engine.global_steps}: the optimizer steps done when the save began.
CHECKPOINT_LINE = re.compile(r"\[Torch\] Checkpoint (\S+) is about to be saved!|Saving model checkpoint: (.*)$")
CHECKPOINT_TAG_STEP = re.compile(r"global_step(\d+)")
# megatron/arguments.py prints it once, from rank 0: "using world size: N, data-parallel-size: ..." since
# Megatron-LM 2.0 ("data-parallel size" since 2023), "using world size: N and model-parallel size: M" before
# it, when training_log printed the iteration line from rank 0 (print_rank_0), not from the last rank.
MEGATRON_WORLD = re.compile(r"using world size: (\d{1,9})(?:, data-parallel[- ]size: \d+| and model-parallel size: \d+)")
MEGATRON_CHECKPOINT = re.compile(r"saving checkpoint at iteration\s+(\d+) to ")
MEGATRON_EVALUATION = re.compile(r"validation loss at iteration\s+(\d+)\s*\|")  # training.py evaluate_and_print_results
# Megatron's resolved arguments (arguments.py _print_args): "  name ....... value" between these lines.
MEGATRON_ARGS_START = re.compile(r"^-+ arguments -+$")
MEGATRON_ARGS_END = re.compile(r"^-+ end of arguments -+$")
MEGATRON_ARG = re.compile(r"^  (\w+) \.{2,} (.*?)\s*$")
MEGATRON_PADDED_VOCAB = re.compile(r"> padded vocab \(size: (\d+)\) with (\d+) dummy tokens \(new size: (\d+)\)")
# The model-shape and batch options MFU and throughput need (Megatron-LM and Megatron-DeepSpeed names).
MEGATRON_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
                       "num_key_value_heads", "group_query_attention", "num_query_groups", "seq_length",
                       "global_batch_size", "micro_batch_size", "padded_vocab_size", "vocab_size",
                       "make_vocab_size_divisible_by", "swiglu",
                       "num_experts", "world_size", "data_parallel_size", "tensor_model_parallel_size",
                       "pipeline_model_parallel_size", "checkpoint_activations", "recompute_granularity",
                       "bf16", "fp16")  # (the last two: the compute dtype of MFU's peak)
MEGATRON_FLAG = re.compile(r"(?:^|\s)--([a-z][a-z0-9-]*)(?:[ =]([^\s-][^\s]*))?(?=\s|$)")
# A command line (the DeepSpeed runner's, or a script's own "cmd = ..." echo) stating the batch.
SCRIPT_CMD = re.compile(r"^cmd = (.*)$")
CMD_MICRO_BATCH = re.compile(r"--(?:per_device_train_batch_size|train_micro_batch_size_per_gpu|micro[-_]batch[-_]size)[ =](\d+)")
CMD_GAS = re.compile(r"--gradient[-_]accumulation[-_]steps[ =](\d+)")
# What ast.literal_eval raises on damaged text: unhashable keys ({[1]: 2}) raise TypeError, deep nesting the last two.
LITERAL_ERRORS = (ValueError, SyntaxError, TypeError, MemoryError, RecursionError)


@dataclass
class Run:
    index: int
    first_line: int = 0  # index of the line that started it
    markers: set = field(default_factory=set)
    has_records: bool = False
    exits_ok: int = 0
    local_procs: int | None = None
    exit_codes: list = field(default_factory=list)
    failed_local_ranks: list = field(default_factory=list)  # of the processes that exited nonzero, when the line says
    signal: str | None = None
    exceptions: list = field(default_factory=list)  # (rank, last exception line)
    steps_done: dict = field(default_factory=dict)  # rank -> optimizer steps closed by a global timer line
    last_timer_step: dict = field(default_factory=dict)  # rank -> the step of its last global timer line
    unsynced_timers: dict = field(default_factory=dict)  # rank -> state.timers rows numbered since the last step=N line
    checkpoint_steps: set = field(default_factory=set)  # optimizer steps done when a checkpoint save began
    evaluation_steps: set = field(default_factory=set)  # optimizer steps done when an evaluation ran (Megatron)
    last_lines: dict = field(default_factory=dict)  # rank -> its last line: line number, text, latest time seen
    comms: dict = field(default_factory=dict)  # rank -> list of comms row dicts (latency still as logged)
    step_lines: dict = field(default_factory=dict)  # (rank, steps done) -> step=N lines seen: one per engine
    engine: dict = field(default_factory=dict)  # rank -> the engine whose step line came last


@dataclass
class LogState:
    rel: str
    file_rank: int | None
    runs: list = field(default_factory=list)
    timers: list = field(default_factory=list)
    scalars: list = field(default_factory=list)
    summary: list = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    garbled: set = field(default_factory=set)  # indices of lines written over by another process, or undecodable
    flops_blocks: list = field(default_factory=list)  # lines of each FLOPs profile printed into the log
    line_index: int = 0  # the line being read
    memory: list = field(default_factory=list)  # memory_usage rows
    line_numbers: list = field(default_factory=list)  # index of a line read -> its line number in the file
    megatron_prints_from_rank0: bool = False  # a Megatron-LM before 2.0: its iteration lines are rank 0's
    engines: int = 0  # DeepSpeed engines printing step lines (DeepSpeed-Chat's RLHF step: actor and critic)
    megatron_step: int | None = None  # the step of the last Megatron iteration line

    def line_number(self, i: int) -> int:
        return self.line_numbers[i] if i < len(self.line_numbers) else i + 1

    @property
    def run(self) -> Run:
        return self.runs[-1]


def claims(path: Path) -> bool:
    # wandb's files/output.log is a copy of rank 0's console: reading it too would count everything twice.
    if not path.name.endswith(SUFFIXES) or (path.name == "output.log" and path.parent.name == "files"
                                            and "run-" in path.parent.parent.name):
        return False
    each_rank = EACH_RANK_LOG.search(path.name) is not None
    try:
        with open(path, "rb") as f:
            carried, read = b"", 0
            while read < SNIFF_LIMIT_BYTES and (block := f.read(PEEK_BYTES if read == 0 else SNIFF_BLOCK_BYTES)):
                read += len(block)
                data = carried + block
                # substring tests first: on text that is no log (a tokenizer's vocab.txt, binary data) decoding
                # and the regexes cost 10-25 ms a MiB
                if (any(marker in data for marker in RECORD_MARKERS) or read == len(block)) and _has_a_record(
                        data.decode("utf-8", "replace")):
                    return True
                if each_rank and TRACEBACK.encode() in data:
                    return True
                carried = data[data.rfind(b"\n") + 1:][-MAX_CARRIED_CHARS:]  # the line the block's end cut
    except OSError:
        return False
    return False


def _has_a_record(text: str) -> bool:
    return bool(LOGGER_LINE.search(text) or TIMER_LINE.search(text) or SUMMARY_HEADER.search(text)
                or MEGATRON_ITERATION.search(text) or PIPELINE_LINE.search(text))


# in every line _has_a_record finds past the file's start
RECORD_MARKERS = (b"] [", b"time (ms)", b"iteration", b"iter time (s)")


# ECMA-48 control sequences (CSI ... final byte: colours, cursor moves) and OSC strings (window titles).
ANSI_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b\n]*(?:\x07|\x1b\\)")


def split_lines(text: str) -> tuple[list[str], list[int]]:
    """The lines a log's records are read from, and each one's line number in the file. A bare carriage
    return (a progress bar redrawn in place: tqdm) also ends a line, as a terminal shows it, but the
    number is the file's line, as an editor and grep count them (newlines only). Colour codes are dropped."""
    lines, numbers = [], []
    if "\x1b" in text:  # a console captured with colours: the records are read, and shown, without them
        text = ANSI_SEQUENCE.sub("", text)
    rows = text.split("\n")
    if rows and rows[-1] == "":
        rows.pop()
    for number, row in enumerate(rows, start=1):
        if "\r" not in row:
            lines.append(row)
            numbers.append(number)
            continue
        parts = row.split("\r")
        if parts[-1] == "":  # the \r of a \r\n line end
            parts.pop()
        lines.extend(parts)
        numbers.extend([number] * len(parts))
    return lines, numbers


def parse(path: Path, rel: str, run_index: int | None = None) -> Imported:
    """The file's records; with run_index, only those of that run of a file holding several appended
    (`run_spans`), as if it were alone in the file (line numbers stay the file's)."""
    try:
        data, issues, ends_with_newline = read_bounded(path)
    except OSError as e:
        return Imported(issues=[["error", "unreadable", 1, str(e)]])
    if not data.strip():
        return Imported(issues=[*issues, ["warning", "empty_file", 1, "empty log; nothing read"]])
    text = data.decode("utf-8", "replace")
    state = LogState(rel=rel, file_rank=rank_in_name(path.name))
    if ignored := rank_in_name_issue(path.name):
        issues.append(ignored)
    state.runs.append(Run(index=0))
    lines, state.line_numbers = split_lines(text)
    _read_lines(state, lines, 0, len(lines))
    at_end = True  # the part read ends the file
    if run_index is not None:
        spans = _spans(state, len(lines))
        at_end = run_index == len(spans) - 1
        if not 0 <= run_index < len(spans):
            return Imported(issues=[["error", "no_such_run", 1, f"the file holds {len(spans)} run(s), not run {run_index}"]])
        first, end = spans[run_index]
        state = LogState(rel=rel, file_rank=state.file_rank, line_numbers=state.line_numbers)
        state.runs.append(Run(index=run_index, first_line=first))
        _read_lines(state, lines, first, end)
        state.facts["log_run"] = {"index": run_index, "runs_in_file": len(spans), "first_line": state.line_number(first),
                                  "last_line": state.line_number(end - 1)}
    if not ends_with_newline and at_end:
        issues.append(["info", "no_final_newline", 1, "the last line has no newline (cut off or still being written)"])
    return _build(state, issues)


def _read_lines(state: LogState, lines: list[str], start: int, end: int) -> None:
    i = start
    while i < end:
        state.line_index = i
        try:
            i = _read_line(state, lines, i)
        except (ValueError, OverflowError):  # a number past int()'s 4300 digits or float's range: the line only
            state.garbled.add(i)
            i += 1


def _spans(state: LogState, line_count: int) -> list[tuple[int, int]]:
    """(first line index, end index) of each run the file holds."""
    starts = [run.first_line for run in state.runs]
    return list(zip(starts, starts[1:] + [line_count]))


def run_spans(path: Path) -> list[tuple[int, int]]:
    """1-based (first line, last line) of each run a log file holds: several when jobs were appended to it."""
    try:
        text = read_bounded(path)[0].decode("utf-8", "replace")
    except OSError:
        return []
    state = LogState(rel=path.name, file_rank=rank_in_name(path.name))
    state.runs.append(Run(index=0))
    lines, state.line_numbers = split_lines(text)
    _read_lines(state, lines, 0, len(lines))
    return [(state.line_number(first), state.line_number(end - 1)) for first, end in _spans(state, len(lines))]


def _rank(state: LogState, line: str, prefix: re.Match | None = None) -> int:
    if prefix is not None:
        return int(prefix[1])
    if m := RANK_PREFIX.search(line) or TORCH_RANK_PREFIX.match(line):
        return int(m[1])
    return state.file_rank if state.file_rank is not None else 0


def _ts_ns(state: LogState, line: str, i: int) -> int | None:
    """The time stamp of line i; None when it has none, or an impossible one (2024-02-30), which counts it garbled."""
    if not (m := TIMESTAMP.match(line)):
        return None
    try:
        stamp = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
    except ValueError:
        state.garbled.add(i)
        return None
    return int(stamp.timestamp()) * 1_000_000_000 + int(m[2]) * 1_000_000


# What a launcher writes before each line of a process's output: pdsh "worker-1: " (DeepSpeed's multi-node
# launcher), mpirun --tag-output "[1,0]<stdout>:", a job runner's "stdout: "; up to three of them.
LAUNCHER_PREFIX = re.compile(r"^(?:[^\s:]{1,64}:\s?){1,3}")


def _is_garbled(line: str) -> bool:
    # A logger timestamp or ds_report key that is not alone at the start (after a launcher's prefix) means two
    # writers shared the line.
    stamps = [m.start() for m in LOG_STAMP.finditer(line)]
    prefix = LAUNCHER_PREFIX.match(line)
    misplaced = len(stamps) > 1 or (stamps and stamps[0] > (prefix.end() if prefix else 0))
    report_keys = REPORT_KEY.findall(line)
    mixed_report = bool(report_keys) and not (len(report_keys) == 1 and REPORT_ROW.match(line))
    return "\ufffd" in line or "\x00" in line or misplaced or mixed_report or line.count("[Rank ") > 1


def _start_run_if_new(state: LogState, marker: str) -> None:
    run = state.run
    launched = run.markers & {"cmd", "world_info"}
    # A script's own "cmd = ..." echo (DeepSpeed-Chat's) starts a run after records only: it precedes the
    # launcher's lines of the same job.
    new = (marker in run.markers or (marker == "cmd" and (run.markers - {"script_cmd"} or run.has_records))
           or (marker == "script_cmd" and run.has_records)
           or (marker == "mpi0" and launched) or (marker == "world_info" and "mpi0" in run.markers))
    if new:
        state.runs.append(Run(index=len(state.runs), first_line=state.line_index))
    state.run.markers.add(marker)


def _read_line(state: LogState, lines: list[str], i: int) -> int:
    """Read line i (and any block it opens); return the index of the next unread line."""
    line = lines[i]
    if _is_garbled(line):
        state.garbled.add(i)
    else:
        _note_last_line(state, line, i)
    if m := TIMER_LINE.search(line):
        _timer(state, m, i)
    elif m := COMM_LINE.search(line):
        _comm(state, m, line, i)
    elif m := STEP_LINE.search(line):
        _step(state, m, i)
    elif m := THROUGHPUT_LINE.search(line):
        _throughput(state, m, line)
    elif m := PIPELINE_LINE.search(line):
        _pipeline(state, m, line)
    elif m := MEGATRON_LINE.match(line):
        _megatron(state, m, line)
    elif m := MEGATRON_TIMER_LINE.match(line):
        _megatron_timers(state, m, i)
    elif m := SEE_MEMORY_USAGE.search(line):
        _see_memory_usage(state, m, lines, i)
    elif m := MEGATRON_MEMORY.search(line):
        _megatron_memory(state, m, i)
    elif SUMMARY_HEADER.match(line):
        return _summary_table(state, lines, i + 1)
    elif FLOPS_HEADER in line:
        return _flops_block(state, lines, i)
    elif m := CONFIG_JSON_START.search(line):
        return _config_json(state, lines, i, m[1])
    elif MEGATRON_ARGS_START.match(line.strip()):
        return _megatron_args(state, lines, i + 1)
    else:
        _launcher_or_status(state, line, i, lines[i - 1] if i else "")
    return i + 1


LAST_LINE_CHARS = 300  # a last line longer than this is cut (a traceback line, a tensor printed whole)


def _note_last_line(state: LogState, line: str, i: int) -> None:
    """The latest line of each rank: a line that names its rank ([Rank N], [rankN]:), or any line of a file that
    holds one rank. Launcher lines belong to no rank. Its time is its own stamp (print()ed lines carry none);
    the latest stamp of the rank's lines up to it says it is no earlier than that."""
    if not line.strip() or "[launch.py:" in line or "[runner.py:" in line:
        return
    if m := RANK_PREFIX.search(line) or TORCH_RANK_PREFIX.match(line):
        rank = int(m[1])
    elif state.file_rank is not None:
        rank = state.file_rank
    else:
        return
    last = state.run.last_lines.setdefault(rank, {"stamped": None})
    last["line"], last["text"], last["own_stamp"] = state.line_number(i), line.strip()[:LAST_LINE_CHARS], bool(TIMESTAMP.match(line))
    if last["own_stamp"]:
        last["stamped"] = (line, i)  # parsed once, at the end


def _timer(state: LogState, m: re.Match, i: int) -> None:
    rank = int(m[1] if m[1] is not None else m[2])
    items = []
    for part in m[3].split("|"):
        if (item := TIMER_ITEM.match(part)) and abs(ms := float(item[2])) <= schema.MAX_TIMER_MS:
            items.append((item[1], ms))
        elif part.strip():  # (1e300 ms, inf: no timer; the line's other items stay)
            state.garbled.add(i)  # a cut or interleaved item: keep the whole ones
    if not items:
        return
    names = {name for name, _ in items}
    if all(name.endswith("_microstep") for name in names):
        scope = "micro"
    elif all(name.startswith("optimizer_") or name in OPTIMIZER_TIMERS for name in names):
        scope = "optimizer"
    else:
        scope = "global"
    run = state.run
    run.has_records = True
    step = run.steps_done.get(rank, 0)
    run.unsynced_timers.setdefault(rank, []).extend(range(len(state.timers), len(state.timers) + len(items)))
    state.timers.extend({"rank": rank, "source": state.rel, "step": step, "line": state.line_number(i), "scope": scope,
                         "timer": name, "ms": ms} for name, ms in items)
    if scope == "global" and names & GLOBAL_TIMERS:
        run.steps_done[rank] = step + 1
        run.last_timer_step[rank] = step


def _sync_timer_steps(state: LogState, rank: int, steps_done: int) -> None:
    """Timer lines carry no step: they are numbered by position, which holds only for a log that starts at
    the run's first step. DeepSpeed prints "step=N" (N optimizer steps done) before step N's own timer lines
    (engine.step: _take_model_step, then timers.log), so at each step=N line the next global timer line is
    0-based step N - 1, and the timers numbered since the last such line move by the difference (a log that
    begins mid-run, rotated or pasted, then numbers its timers as its step=N lines do)."""
    run = state.run
    if steps_done < 1:
        return
    # (its timers already printed before this line: it closed step N - 1, the next one is N)
    expected = steps_done if run.last_timer_step.get(rank) == steps_done - 1 else steps_done - 1
    shift = expected - run.steps_done.get(rank, 0)
    rows = run.unsynced_timers.pop(rank, [])
    if shift and all(state.timers[r]["step"] + shift >= 0 for r in rows):
        for r in rows:
            state.timers[r]["step"] += shift
        if rank in run.last_timer_step:
            run.last_timer_step[rank] += shift
    run.steps_done[rank] = expected


def _comm(state: LogState, m: re.Match, line: str, i: int) -> None:
    rank = _rank(state, line)
    op, caller = comms_dump.split_record_name(m[1].strip())
    msg_bytes = comms_dump.size_from_text(m[3])
    if msg_bytes is None:  # no size as DeepSpeed prints one ("1.2.3 MB"): the call is kept, as dropping it
        state.garbled.add(i)  # would fold its time into the next difference of a running total
    state.run.has_records = True
    state.run.comms.setdefault(rank, []).append({
        "record": m[1].strip(), "rank": rank, "source": state.rel, "ts_ns": _ts_ns(state, line, i), "op": op,
        "caller": caller, "msg_bytes": msg_bytes, "logged_ms": float(m[2]), "line": state.line_number(i),
    })


def _samples(state: LogState, steps_done: int) -> int | None:
    """Samples trained after `steps_done` optimizer steps: 0 before the first (DeepSpeed's step=0 line comes before
    its config dump), else steps x train_batch_size once the dump gave it."""
    batch = state.facts.get("train_batch_size")
    return 0 if steps_done == 0 else steps_done * batch if isinstance(batch, int) else None


def _scalar(state: LogState, rank: int, name: str, value: float, steps_done: int | None, line: str,
            samples: int | None = None, tokens: int | None = None) -> None:
    state.run.has_records = True
    state.scalars.append({
        "rank": rank, "source": state.rel, "origin": "log", "name": name,
        "step": steps_done - 1 if steps_done else None,
        "global_samples": samples if samples is not None else (_samples(state, steps_done) if steps_done is not None else None),
        "global_tokens": tokens, "value": value, "wall_ns": _ts_ns(state, line, state.line_index),
    })


def _step(state: LogState, m: re.Match, i: int) -> None:
    line = m.string
    rank, steps_done = int(m[1]), int(m[2])
    # Several engines in one process (DeepSpeed-Chat's actor and critic) each print step=N: the k-th line of a
    # step is engine k's, and its scalars are engine<k>/<name>, not a second value of the first engine's.
    engine = state.run.step_lines.get((rank, steps_done), 0)
    state.run.step_lines[(rank, steps_done)] = engine + 1
    state.run.engine[rank] = engine
    state.engines = max(state.engines, engine + 1)
    if engine == 0:
        _sync_timer_steps(state, rank, steps_done)
    _scalar(state, rank, _engine_name(engine, "skipped_steps"), float(m[3]), steps_done, line)
    lrs = [x.strip() for x in m[4].split(",") if x.strip()]
    if lrs:
        try:
            _scalar(state, rank, _engine_name(engine, "lr"), float(lrs[0]), steps_done, line)
        except ValueError:
            state.garbled.add(i)


def _pipeline(state: LogState, m: re.Match, line: str) -> None:
    rank, steps_done = _rank(state, line), int(m[1])
    for name, value in (("loss", m[2]), ("iter time (s)", m[3]), ("samples/sec", m[4])):
        _scalar(state, rank, name, float(value), steps_done, line)


def _engine_name(engine: int, name: str) -> str:
    return f"engine{engine}/{name}" if engine else name


def _throughput(state: LogState, m: re.Match, line: str) -> None:
    rank = _rank(state, line)
    steps_done = int(m[1] or m[2])
    # Before 0.8 the line began "<epoch>/<micro_step>": a micro-step count, not optimizer steps.
    steps = steps_done if m[1] else None
    engine = state.run.engine.get(rank, 0)  # printed right after its engine's step line
    for name, value in (("RunningAvgSamplesPerSec", m[3] or m[5]), ("CurrSamplesPerSec", m[4]),
                        ("MemAllocated_GB", m[6]), ("MaxMemAllocated_GB", m[7])):
        if value is not None:
            _scalar(state, rank, _engine_name(engine, name), float(value), steps, line)
    if m[6] is not None and engine == 0:
        # The device allocator's figures / 1024**3 rounded to 2 decimals (utils/timer.py): max_memory_allocated is
        # the process's running peak (since its last reset: see_memory_usage resets it).
        state.memory.append({
            "rank": rank, "source": state.rel, "line": state.line_number(state.line_index), "origin": "deepspeed_throughput",
            "message": None, "step": steps - 1 if steps else None, "allocated_bytes": round(float(m[6]) * GIB),
            "max_allocated_bytes": round(float(m[7]) * GIB), "reserved_bytes": None, "max_reserved_bytes": None,
            "resolution_bytes": SEE_MEMORY_RESOLUTION_BYTES, "wall_ns": _ts_ns(state, line, state.line_index),
        })


def _log_world_size(facts: dict) -> int | None:
    """The world size the log states: a launcher's, MPI's or Megatron's line, else DeepSpeedConfig's world_size (the
    data-parallel size: the job's under no model parallelism only)."""
    return facts.get("world_size") or facts.get("dp_world_size")


def _megatron_rank(state: LogState) -> int | None:
    """megatron/training.py training_log prints with print_rank_last (rank world_size - 1); before 2.0 with
    print_rank_0."""
    world_size = _log_world_size(state.facts)
    last_rank = 0 if state.megatron_prints_from_rank0 else (world_size - 1 if world_size else None)
    return state.file_rank if state.file_rank is not None else last_rank


def _megatron_timers(state: LogState, m: re.Match, i: int) -> None:
    """Scope megatron_interval, on the step of the iteration line before it (null before any)."""
    items = []
    for part in m[1].split("|"):
        if item := MEGATRON_ITEM.match(part):
            items.append((item[1].strip(), float(item[2])))
        elif part.strip():
            state.garbled.add(i)
    state.run.has_records = True
    state.timers.extend({"rank": _megatron_rank(state), "source": state.rel, "step": state.megatron_step,
                         "line": state.line_number(i), "scope": "megatron_interval", "timer": name, "ms": ms}
                        for name, ms in items)


def _megatron(state: LogState, m: re.Match, line: str) -> None:
    rank = _megatron_rank(state)
    fields = {}
    for part in m[3].split("|"):
        if item := MEGATRON_ITEM.match(part):
            fields[item[1].strip()] = float(item[2])
    samples = _whole(fields.pop("consumed samples", None))
    tokens = _whole(fields.pop("consumed tokens", None))
    steps_done = int(m[1])
    state.megatron_step = steps_done - 1 if steps_done else None
    for name, value in fields.items():
        _scalar(state, rank, name, value, steps_done, line, samples=samples, tokens=tokens)


def _whole(count: float | None) -> int | float | None:
    """A count printed as a number, as an int; nan and inf stay floats, which conform stores as null and counts."""
    try:
        return int(count) if count is not None else None
    except (ValueError, OverflowError):
        return count


def _see_memory_usage(state: LogState, m: re.Match, lines: list[str], i: int) -> None:
    """DeepSpeed's see_memory_usage figures; its message is the line printed just before them."""
    line = m.string
    before = lines[i - 1] if i > 0 else ""
    if said := SEE_MEMORY_MESSAGE.search(before):
        message = said[1]
    else:  # print() form (DeepSpeed 0.19 prints, 0.7 logged): the bare line before, unless it is another record
        message = before.strip() if before.strip() and not LOGGER_LINE.search(before) and i - 1 not in state.garbled else None
    allocated, max_allocated, reserved, max_reserved = (round(float(value) * GIB) for value in m.groups())
    state.run.has_records = True
    state.memory.append({
        "rank": _rank(state, line), "source": state.rel, "line": state.line_number(i), "origin": "see_memory_usage", "message": message,
        "allocated_bytes": allocated, "max_allocated_bytes": max_allocated, "reserved_bytes": reserved,
        "max_reserved_bytes": max_reserved, "resolution_bytes": SEE_MEMORY_RESOLUTION_BYTES, "wall_ns": _ts_ns(state, line, i),
    })


def _megatron_memory(state: LogState, m: re.Match, i: int) -> None:
    allocated, max_allocated, reserved, max_reserved = (round(float(value) * MIB) for value in m.groups()[3:])
    state.run.has_records = True
    state.memory.append({
        "rank": int(m[1]), "source": state.rel, "line": state.line_number(i), "origin": "megatron_report_memory", "message": m[2],
        "step": int(m[3]) - 1, "allocated_bytes": allocated, "max_allocated_bytes": max_allocated,
        "reserved_bytes": reserved, "max_reserved_bytes": max_reserved, "resolution_bytes": 0,
        "wall_ns": _ts_ns(state, m.string, i),
    })


def _summary_table(state: LogState, lines: list[str], i: int) -> int:
    """Rows of a log_summary table (comms_logging.py log_all: fixed 20-character columns) after its header."""
    rank = _rank(state, "")
    record = None
    while i < len(lines):
        line = lines[i]
        if row := SUMMARY_ROW.match(line):
            if record is not None:
                op, caller = comms_dump.split_record_name(record)
                msg_bytes = comms_dump.size_from_text(row[1])
                if msg_bytes is None:  # a size too large for a row
                    state.garbled.add(i)
                try:
                    state.summary.append({
                        "rank": rank, "source": state.rel, "op": op, "caller": caller, "msg_bytes": msg_bytes,
                        "count": int(row[2]), "total_latency_ms": float(row[3]), "avg_latency_ms": float(row[4]),
                        "busbw_gbps": float(row[6]), "run_index": state.run.index,
                    })
                except ValueError:  # a count past int()'s 4300 digits: that row only
                    state.garbled.add(i)
        elif op_line := SUMMARY_OP.match(line):
            record = op_line[1]
        else:
            break  # "____" then the straggler table, a blank line, or the next log line
        i += 1
    state.run.has_records = True
    return i


def _flops_block(state: LogState, lines: list[str], i: int) -> int:
    """A FLOPs profile printed into the log (no output_file): up to its closing dashes line."""
    end = i + 1
    while end < len(lines) and not (lines[end].startswith("-----") and set(lines[end].strip()) == {"-"}):
        end += 1
    state.flops_blocks.append(lines[i:end + 1])
    return end + 1


def _config_json(state: LogState, lines: list[str], i: int, first: str) -> int:
    """The user's ds_config, printed as indented JSON (config.py print_user_config) at log_level info."""
    block, depth, j = [first], first.count("{") - first.count("}"), i + 1
    while depth > 0 and j < len(lines) and j - i < 2000:
        block.append(lines[j])
        depth += lines[j].count("{") - lines[j].count("}")
        j += 1
    try:
        config = json.loads("\n".join(block))
    except (ValueError, RecursionError):
        state.garbled.add(i)
        return i + 1
    state.facts["ds_config"] = config
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if isinstance(config.get(key), int):
            state.facts.setdefault(key, config[key])
    stage = (config.get("zero_optimization") or {}).get("stage") if isinstance(config.get("zero_optimization"), dict) else None
    if isinstance(stage, int):
        state.facts["zero_stage"] = stage
    return j


def _arg_value(text: str):
    """A Megatron argument as printed (str() of the value): int, float, bool, None, list, or the text."""
    try:
        return ast.literal_eval(text)
    except LITERAL_ERRORS:
        return text


def _megatron_args(state: LogState, lines: list[str], i: int) -> int:
    """Megatron's resolved arguments (the model shape and batch among them) -> facts["megatron_args"]."""
    args = state.facts.setdefault("megatron_args", {})
    while i < len(lines) and not MEGATRON_ARGS_END.match(lines[i].strip()) and not TIMESTAMP.match(lines[i]):
        if (m := MEGATRON_ARG.match(lines[i])) and m[1] in MEGATRON_SHAPE_ARGS:
            args[m[1]] = _arg_value(m[2])  # a value cut by another rank's write is garbled text, not a number
        i += 1
    if type(args.get("world_size")) is int and args["world_size"] > 0:
        state.facts.setdefault("world_size", args["world_size"])
    return i + 1


def _command_line(state: LogState, command: str) -> None:
    """Batch options of a command line, and the Megatron shape options it gives (the arguments block,
    printed later with the resolved values, overrides them)."""
    if m := CMD_MICRO_BATCH.search(command):
        state.facts.setdefault("cmd_micro_batch", int(m[1]))
    if m := CMD_GAS.search(command):
        state.facts.setdefault("cmd_gradient_accumulation_steps", int(m[1]))
    args = state.facts.setdefault("megatron_args", {})
    for flag, value in MEGATRON_FLAG.findall(command):
        name = flag.replace("-", "_")
        if name in MEGATRON_SHAPE_ARGS and name not in args:
            args[name] = True if value == "" else _arg_value(value)
    if not args:
        del state.facts["megatron_args"]


# The steplens collector's own warning: a traceback right after it (older collectors logged one) is an exception the
# collector caught, not the job's.
COLLECTOR_WARNING = "steplens collector:"


def _launcher_or_status(state: LogState, line: str, i: int, previous: str = "") -> None:
    facts = state.facts
    if RUNNER_CMD.search(line):
        _start_run_if_new(state, "cmd")
        _command_line(state, line)
    elif m := SCRIPT_CMD.match(line):
        _start_run_if_new(state, "script_cmd")
        _command_line(state, m[1])
    elif m := MEGATRON_PADDED_VOCAB.search(line):
        state.facts.setdefault("megatron_args", {})["padded_vocab_size"] = int(m[3])
    elif m := WORLD_INFO.search(line):
        _start_run_if_new(state, "world_info")
        try:
            facts["world_info"] = ast.literal_eval(m[1])
        except LITERAL_ERRORS:
            state.garbled.add(i)
    elif m := MPI_RANK0.search(line):
        _start_run_if_new(state, "mpi0")
        facts["world_size"] = int(m[1])
    elif m := DIST_WORLD_SIZE.search(line):
        facts["world_size"] = int(m[1])
    elif m := MEGATRON_WORLD.search(line):  # the job's world size (the launcher's, when it printed one, is the same)
        facts.setdefault("world_size", int(m[1]))
        state.megatron_prints_from_rank0 = "model-parallel size" in m[0]
    elif (m := NUM_LOCAL_PROCS.search(line)) and "[launch.py" in line:
        state.run.local_procs = int(m[1])
    elif m := DS_ACCELERATOR.search(line):
        facts["ds_accelerator"] = m[1]
    elif m := NCCL_VERSION.search(line):
        facts.setdefault("nccl_version", m[1])
    elif m := DS_VERSION.search(line):
        facts["deepspeed_version"] = m[1]
    elif m := REPORT_VERSION.match(line):
        facts.setdefault(f"{m[1].replace(' ', '_')}_version", m[2])
    elif m := CONFIG_ITEM.search(line):
        key, value = m[1], m[2].strip()
        if key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps") and value.isdigit():
            facts[key] = int(value)
        elif key in ("bfloat16_enabled", "fp16_enabled") and value in ("True", "False"):
            facts[key] = value == "True"  # the compute dtype of MFU's peak (mfu.compute_dtype)
        elif key == "world_size" and value.isdigit():
            # DeepSpeedConfig's world_size is the data-parallel group's size (mpu given): the job's under
            # no model parallelism only, so it is the world size only where nothing else states one.
            facts["dp_world_size"] = int(value)
    elif m := CHECKPOINT_LINE.search(line):
        if step := CHECKPOINT_TAG_STEP.search(m[1] or m[2]):
            state.run.checkpoint_steps.add(int(step[1]))
            state.run.has_records = True
    elif m := MEGATRON_CHECKPOINT.search(line):
        state.run.checkpoint_steps.add(int(m[1]))
        state.run.has_records = True
    elif m := MEGATRON_EVALUATION.search(line):
        state.run.evaluation_steps.add(int(m[1]))
    elif EXIT_OK.search(line):
        state.run.exits_ok += 1
    elif m := EXIT_CODE.search(line):
        state.run.exit_codes.append(int(m[1]))
        if (local := LAUNCHED_LOCAL_RANK.search(line)) and int(m[1]) != 0:
            state.run.failed_local_ranks.append(int(local[1]))
    elif (m := KILLED.search(line)) and "sigkill_handler" in line:
        state.run.signal = m[1]
    elif (line.startswith(TRACEBACK) or line.endswith(TRACEBACK)) and COLLECTOR_WARNING not in previous:
        state.run.exceptions.append([_rank(state, line), None])
    elif state.run.exceptions and (m := EXCEPTION_LINE.match(
            (unprefixed := TORCH_RANK_PREFIX.sub("", line, count=1).removeprefix(" ")).rstrip())) \
            and not unprefixed[:1].isspace():
        state.run.exceptions[-1][1] = unprefixed.strip()  # torch's "[rankN]: " prefix off, the line as printed


def _status(run: Run, file_rank: int | None) -> dict:
    errors = [e for _, e in run.exceptions if e]
    failed_codes = [c for c in run.exit_codes if c != 0]
    launched = bool(run.markers & {"cmd", "world_info"})
    if run.signal:
        status, detail = "killed", f"the launcher received {run.signal} and killed its ranks"
        error = f"received {run.signal}"
    elif signalled := [c for c in failed_codes if c < 0]:  # subprocess returncode -N: ended by signal N
        status, error = "killed", f"a rank was ended by signal {-signalled[0]}"
        detail = f"a rank exited with return code {signalled[0]} (launcher sigkill_handler)"
    elif failed_codes:
        status, error = "failed", errors[-1] if errors else None
        who = (f"local rank {run.failed_local_ranks[0]}" if run.failed_local_ranks else "a rank")
        detail = f"{who} exited with return code {failed_codes[0]} (launcher sigkill_handler)"
    elif run.exits_ok and (run.local_procs is None or run.exits_ok >= run.local_procs):
        # Every process exited 0: a traceback before that was caught and printed, not fatal.
        status, error = "completed", None
        detail = f"{run.exits_ok} process(es) exited successfully (launcher)" + (
            f"; {len(errors)} traceback(s) printed before that" if errors else "")
    elif errors:
        status, error, detail = "failed", errors[-1], f"{len(errors)} traceback(s); no successful exit after them"
    elif launched:
        status, error = "incomplete", None
        detail = f"started by the launcher; {run.exits_ok} of {run.local_procs or '?'} processes reported an exit"
    else:
        status, error, detail = "unknown", None, "no launcher exit record in this file (see the launcher's log)"
    return {"rank": None if launched else file_rank, "run_index": run.index, "status": status,
            "exit_code": failed_codes[0] if failed_codes else (0 if status == "completed" else None),
            "error": error, "detail": detail}


def _comms_rows(state: LogState, issues: list) -> list[dict]:
    """Per run and rank: detect running totals per record name, repair them, number the calls."""
    rows = []
    world_size = state.facts.get("world_size")
    for run in state.runs:
        for rank, calls in run.comms.items():
            by_record: dict[str, list[dict]] = {}
            for call in calls:
                by_record.setdefault(call["record"], []).append(call)
            cumulative = comms_dump.is_running_total(_finite_series(by_record.values()))
            for group in by_record.values():
                logged = [c["logged_ms"] for c in group]
                latencies = comms_dump.per_call(logged) if cumulative else logged
                for call, latency in zip(group, latencies):
                    try:
                        call["latency_ns"] = round(latency * 1e6)
                    except (ValueError, OverflowError):  # logged nan or inf, or the running total after one:
                        call["latency_ns"] = latency  # conform stores it as null and counts it
            for index, call in enumerate(calls):
                rows.append({
                    "rank": rank, "source": state.rel, "call_index": len(rows), "ts_ns": call["ts_ns"], "op": call["op"],
                    "caller": call["caller"], "msg_bytes": call["msg_bytes"], "group_size": world_size,
                    "latency_ns": call["latency_ns"], "synchronized": True,
                    "latency_origin": "repaired_cumulative" if cumulative else "as_logged",
                })
            comms_dump.report_cumulative(cumulative, f"run {run.index}, rank {rank}: ", len(calls), issues)
    if rows and world_size is None:
        issues.append(["warning", "no_world_size", len(rows), "world size not in the log; no nccl_bytes/bandwidth"])
    return rows


def _finite_series(groups) -> list[list[float]]:
    """Logged latencies per record name, for telling running totals: a nan or inf would hide (or fake) a decrease."""
    return [[c["logged_ms"] for c in calls if math.isfinite(c["logged_ms"])] for calls in groups]


def _batch_facts(state: LogState, issues: list) -> None:
    """train_batch_size and seq_len where the log states them (a config dump, Megatron's arguments),
    else train_batch_size from the throughput lines: CurrSamplesPerSec (train_batch_size / that
    step's time) x the wall time between two throughput lines / the optimizer steps between them,
    median over the run's intervals that hold no checkpoint save (a save's seconds are no step's: with
    a save every logging interval they made a real HelloDeepSpeed log's 8 samples 16), rounded to a
    multiple of the per-device batch the command line states (a batch is micro batch x accumulation x
    data-parallel ranks). Without a stated per-device batch the estimate is too rough to count
    samples with, and the batch stays unknown."""
    facts, args = state.facts, state.facts.get("megatron_args") or {}
    for fact, arg in (("train_batch_size", "global_batch_size"), ("seq_len", "seq_length")):
        if isinstance(args.get(arg), int) and not isinstance(args[arg], bool):
            facts.setdefault(fact, args[arg])
    if isinstance(facts.get("train_batch_size"), int):
        return
    if state.engines > 1:  # the time between one engine's throughput lines holds the others' steps too
        return
    rates = [r for r in state.scalars if r["name"] == "CurrSamplesPerSec" and r["step"] is not None
             and r["wall_ns"] is not None and r["value"] > 0]
    saves = set().union(*(run.checkpoint_steps for run in state.runs))  # a save's time is no step's
    estimates = [_batch_estimate(before, now) for before, now in zip(rates, rates[1:])
                 if now["rank"] == before["rank"] and now["step"] > before["step"]
                 and not any(before["step"] <= save <= now["step"] for save in saves)]
    estimates = [e for e in estimates if e is not None and math.isfinite(e)]  # an inf rate tells no batch
    unit = facts.get("train_micro_batch_size_per_gpu") or facts.get("cmd_micro_batch")
    if not estimates:
        return
    estimate = sorted(estimates)[len(estimates) // 2]
    if not unit:
        issues.append(["info", "train_batch_size_unknown", len(rates),
                       f"throughput lines imply about {estimate:.1f} samples per step, but no per-device batch is stated "
                       "to round that to: global_samples left null"])
        return
    batch = max(round(estimate / unit), 1) * unit
    facts["train_batch_size"] = batch
    facts["train_batch_size_origin"] = (
        f"CurrSamplesPerSec x time between throughput lines / steps between them: median {estimate:.1f} over "
        f"{len(estimates)} intervals, rounded to a multiple of the per-device batch {unit} on the command line")
    issues.append(["info", "train_batch_size_inferred", 1, f"train_batch_size {batch}: {facts['train_batch_size_origin']}"])


def _batch_estimate(before: dict, now: dict) -> float | None:
    """Samples per step between two throughput lines; None when a damaged step or time (past float's range) gives none."""
    try:
        return now["value"] * (now["wall_ns"] - before["wall_ns"]) / 1e9 / (now["step"] - before["step"])
    except OverflowError:
        return None


def _fill_global_samples(state: LogState) -> None:
    """global_samples = optimizer steps done x train_batch_size for log scalars that lack it (lines
    read before the batch was known, or a batch inferred at the end). DeepSpeed counts fp16-skipped
    steps in global_steps and global_samples alike."""
    batch = state.facts.get("train_batch_size")
    if not isinstance(batch, int):
        return
    for row in state.scalars:
        if row["global_samples"] is None and row["step"] is not None:
            row["global_samples"] = (row["step"] + 1) * batch


def _build(state: LogState, issues: list) -> Imported:
    tables: dict[str, pl.DataFrame] = {}
    if world_size := _log_world_size(state.facts):
        state.facts["world_size"] = world_size
    # conform(..., issues): a value its column cannot hold (a 20-digit rank, a year-9999 stamp in ns) is null, counted.
    if state.timers:
        tables["step_timers"] = conform(state.timers, "step_timers", issues)
    _batch_facts(state, issues)
    _fill_global_samples(state)
    if state.scalars:
        tables["scalars"] = conform(state.scalars, "scalars", issues)
    if comms := _comms_rows(state, issues):
        tables["comms_calls"] = with_bandwidth(conform(comms, "comms_calls", issues))
    if state.memory:
        tables["memory_usage"] = conform(state.memory, "memory_usage", issues)
    if state.summary:
        trust = {run.index: _verbose_trust(run) for run in state.runs}
        rows = [{**{k: v for k, v in row.items() if k != "run_index"}, "trusted": trust[row["run_index"]]}
                for row in state.summary]
        tables["comms_summary"] = conform(rows, "comms_summary", issues)
        if unknown := sum(row["trusted"] is None for row in rows):
            issues.append(["info", "comms_summary_trust_unknown", unknown,
                           ("log_summary table without verbose comms lines in the same run: whether its latencies are "
                           "running totals (DeepSpeed >= 0.18.3) cannot be told; trusted left null")])
    # A run_status row needs evidence: launcher lines, exits, a signal or a traceback.
    statuses = [_status(run, state.file_rank) for run in state.runs
                if run.markers or run.exceptions or run.exits_ok or run.exit_codes or run.signal]
    if statuses:
        tables["run_status"] = conform([{**s, "source": state.rel} for s in statuses], "run_status", issues)
    if len(state.runs) > 1:
        issues.append(["info", "several_runs", len(state.runs), f"{len(state.runs)} runs appended to one file"])
    facts = {k: v for k, v in state.facts.items() if k not in ("world_info", "cmd_micro_batch", "cmd_gradient_accumulation_steps")}
    if len(state.runs) > 1:
        facts["runs_in_file"] = len(state.runs)
    if checkpoints := set().union(*(run.checkpoint_steps for run in state.runs)):
        facts["checkpoint_steps"] = sorted(checkpoints)
    if evaluations := set().union(*(run.evaluation_steps for run in state.runs)):
        facts["evaluation_steps"] = sorted(evaluations)
    for rank, last in state.runs[-1].last_lines.items():  # the last run of the file: how the job ended
        stamped_ns = _ts_ns(state, *last["stamped"]) if last["stamped"] else None
        facts[f"log_last_line_rank{rank}"] = {"line": last["line"], "text": last["text"], "source": state.rel,
                                              "wall_ns": stamped_ns if last["own_stamp"] else None,
                                              "not_before_ns": stamped_ns}
    for block in state.flops_blocks:
        embedded = flops_text.parse_lines(block, state.rel, facts)
        issues.extend(embedded.issues)
        if "flops_profile" in embedded.tables:
            tables["flops_profile"] = pl.concat([tables.get("flops_profile", embedded.tables["flops_profile"].clear()),
                                                 embedded.tables["flops_profile"]])
        facts.setdefault("flops_profiler", embedded.facts)
    if state.engines > 1:
        issues.append(["info", "several_engines", state.engines,
                       f"{state.engines} DeepSpeed engines print step lines in this log (DeepSpeed-Chat's actor and critic, "
                       "say); told apart by their order within each step, the second engine's scalars are named "
                       "engine1/<name>, a third's engine2/<name> (the first's keep their names); no batch size is "
                       "inferred from throughput"])
    if garbled := len({state.line_number(i) for i in state.garbled}):  # counted last: the last lines' stamps can add some
        issues.append(["info", "garbled_lines", garbled,
                       (f"{garbled} lines hold interleaved writes from several processes, undecodable bytes "
                        "or damaged values (an impossible date, a number too long to read); records in them that did "
                        "not parse whole were skipped, damaged values in kept records are null")])
    if not tables and not facts:
        issues.append(["info", "no_records", 1, "DeepSpeed markers but no timer, step, comms or status lines"])
    return Imported(tables=tables, issues=issues, facts=facts)


def _verbose_trust(run: Run) -> bool | None:
    """A run's log_summary is trusted when its verbose lines were per call, not when they were running
    totals, and unknown without verbose lines."""
    series = _finite_series([c for c in calls if c["record"] == record]
                            for calls in run.comms.values() for record in {c["record"] for c in calls})
    cumulative = comms_dump.is_running_total(series)
    return None if cumulative is None else not cumulative
