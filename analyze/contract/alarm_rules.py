"""Alarm rules: one implementation for the in-job collector and for the post-hoc analysis.

The collector (collect/alarms.py) feeds an `AlarmEngine` on rank 0 at each flush with the rows it just
flushed; `analyze` replays the same rules over the recorded tables (`replay`), and its post-hoc
`monitor_alarms` analysis (analyze/analyses/monitor.py) feeds every scalar series of a run, whatever wrote it
(collector, csv_monitor, TensorBoard, W&B, logs), through an `AlarmEngine` too. All see the points of a series
in the same order and keep the same trailing state, so they raise the same alarms at the same steps. Pure
Python, standard library only: it runs inside training jobs, beside torch, and imports neither torch nor
polars.

Rules (`kind`), what they watch and their `threshold`:
  nonfinite        loss and grad-norm scalars: the value is NaN or +-inf                      (none)
  loss_spike       loss scalars: modified z-score against the trailing `window` finite points  z, 3.5
                   and a change of at least `min_change` (5%) from their median
  grad_norm_spike  grad-norm scalars: the same robust z and change against the trailing window z, 3.5
  grad_norm_high   grad-norm scalars: the value is above the threshold                        required
  memory_growth    memory scalars: the value is above the median of the first `window` points by more
                   than the fraction                                                          0.2
  slow_step        optimizer step time above factor x the trailing median of `window` steps   3.0
                   (also step-time scalars, e.g. elapsed time per iteration: same test on the value)
  throughput_drop  median samples/s of the last `recent` steps below (1 - fraction) x the median of the
                   `window` steps before them (also rate scalars, e.g. samples/sec)          0.2
  straggler        a rank's busy time (time since its previous step ended, minus its comms time: a rank that
                   waits for a slow one waits in collectives) above factor x the median of the other
                   ranks' for `recent` consecutive steps                                      1.5
  no_progress      no optimizer step ended for `threshold` seconds (a watchdog in the job; gaps post hoc) 600

slow_step and throughput_drop neither judge nor remember the steps an engine is told to skip (`skip_steps`: steps
the run instrumented, such as profiler windows and FLOPs-profiled steps, whose time is the instrument's).
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections import deque

from steplens.analyze.contract.manifest import MAX_STEP

# Which scalar tags are what (DeepSpeed's Train/Samples/* tags and the usual names of other loggers).
LOSS = re.compile(r"loss(?!_?scale)", re.IGNORECASE)
GRAD_NORM = re.compile(r"grad[_\- /]?norm", re.IGNORECASE)
RATE = re.compile(r"throughput|samples_?per_?s|tokens_?per_?s|samples/s|tokens/s|tflops|flops_per|it/s",
                  re.IGNORECASE)  # samples_per_s(ec), DeepSpeed's CurrSamplesPerSec
# Step-time tags: DeepSpeed's Train/Samples/elapsed_time_ms_*, Megatron's "elapsed time per iteration (ms)".
DURATION = re.compile(r"elapsed[_ ]time|step[_ ]time|iter(ation)?[_ ]time|latency|_ms(_|$)", re.IGNORECASE)
MEMORY = re.compile(r"mem(ory)?|allocated|reserved|rss", re.IGNORECASE)

# Robust z-score: the modified z-score 0.6745 (x - median) / MAD of Iglewicz & Hoaglin, "How to Detect and
# Handle Outliers" (ASQC, 1993), who recommend flagging |z| > 3.5.
MAD_Z_SCALE = 0.6745
SPIKE_Z = 3.5
# A spike must also move the value this much from the trailing median: on a flat series (a loss that changes in
# its third decimal) the MAD is tiny and a 0.6% step scores z = 3.6 (seen on a real H200 job), which is noise.
MIN_SPIKE_CHANGE = 0.05

SCALAR_KINDS = ("nonfinite", "loss_spike", "grad_norm_spike", "grad_norm_high", "memory_growth")
STEP_KINDS = ("slow_step", "throughput_drop")  # from train_steps, and from scalar tags their pattern matches
KINDS = (*SCALAR_KINDS, *STEP_KINDS, "straggler", "no_progress")
SEVERITIES = ("info", "warning", "critical")
# kind -> (default threshold, default tag pattern or None); the patterns, as text in a rule, keep their
# case-insensitivity inline ("(?i)"), so CurrSamplesPerSec is a rate and Train/Samples/Loss a loss.
DEFAULTS = {
    "nonfinite": (None, f"(?i){LOSS.pattern}|{GRAD_NORM.pattern}"), "loss_spike": (SPIKE_Z, f"(?i){LOSS.pattern}"),
    "grad_norm_spike": (SPIKE_Z, f"(?i){GRAD_NORM.pattern}"), "grad_norm_high": (None, f"(?i){GRAD_NORM.pattern}"),
    "memory_growth": (0.2, f"(?i){MEMORY.pattern}"), "slow_step": (3.0, f"(?i){DURATION.pattern}"),
    "throughput_drop": (0.2, f"(?i){RATE.pattern}"), "straggler": (1.5, None), "no_progress": (600.0, None),
}
DEFAULT_KINDS = ("nonfinite", "loss_spike", "throughput_drop", "slow_step", "no_progress")
ALARM_FIELDS = ("rule", "name", "step", "global_samples", "value", "threshold", "severity", "rank", "wall_ns", "detail")


def modified_z(value: float, around: list[float]) -> float | None:
    """Iglewicz & Hoaglin's modified z-score of `value` against `around`; None when their spread (MAD) is 0."""
    median = statistics.median(around)
    mad = statistics.median(abs(x - median) for x in around)
    return MAD_Z_SCALE * (value - median) / mad if mad > 0 else None


@dataclasses.dataclass(frozen=True)
class Rule:
    """One entry of the ds_config `"steplens": {"alarms": [...]}` list."""

    kind: str
    match: str | None = None  # regular expression over scalar tags (scalar rules); default per kind
    threshold: float | None = None  # see the module docstring, per kind
    window: int = 50  # trailing points (or steps) a value is judged against
    min_history: int = 8  # fewer points before it: not judged (the first steps are warm-up)
    recent: int = 3  # throughput_drop: steps whose median is compared; straggler: consecutive steps
    min_change: float = MIN_SPIKE_CHANGE  # loss_spike, grad_norm_spike: least relative change from the median
    severity: str = "warning"
    cooldown_steps: int = 100  # after an alarm, the same rule on the same series is quiet this many steps
    once: bool = False  # at most one alarm per series for the whole job
    stop_training: bool = False  # an alarm sets collector.stop_requested (the job decides; nothing is stopped)

    @classmethod
    def parse(cls, entry: dict) -> Rule:
        if not isinstance(entry, dict) or entry.get("kind") not in KINDS:
            raise ValueError(f"steplens alarms: each rule is a dict with kind one of {list(KINDS)}; got {entry!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := set(entry) - known:
            raise ValueError(f"steplens alarms: unknown rule keys {sorted(unknown)}; known: {sorted(known)}")
        threshold, pattern = DEFAULTS[entry["kind"]]
        rule = cls(**{"threshold": threshold, "match": pattern, **entry})
        if rule.kind == "grad_norm_high" and rule.threshold is None:
            raise ValueError("steplens alarms: grad_norm_high needs a threshold")
        if rule.severity not in SEVERITIES:
            raise ValueError(f"steplens alarms: severity is one of {list(SEVERITIES)}, not {rule.severity!r}")
        if min(rule.window, rule.recent, rule.min_history + 1) < 1 or rule.cooldown_steps < 0 or not rule.min_change >= 0:
            raise ValueError("steplens alarms: window, recent >= 1; min_history, cooldown_steps, min_change >= 0")
        if rule.match is not None:
            re.compile(rule.match)
        return rule


def parse_rules(entries: list | None) -> list[Rule]:
    """The rules of a config: None (no `alarms` key) gives the default rules, [] none."""
    if entries is None:
        entries = [{"kind": kind, "severity": "critical" if kind == "nonfinite" else "warning"} for kind in DEFAULT_KINDS]
    if not isinstance(entries, list):
        raise ValueError("steplens alarms: a list of rules")
    return [Rule.parse(entry) for entry in entries]


def step_times(rows) -> list[dict]:
    """Optimizer steps of one rank from its train_steps rows (micro steps of a step together): step,
    step_ns = last end - first start, cycle_ns = end - the previous step's end (what the rank spent between
    two steps, data loading included; step_ns when the previous step is not in `rows`), global_samples at
    the boundary, wall_ns = the end. Complete steps only."""
    steps: dict[int, dict] = {}
    for row in rows:
        step = steps.setdefault(row["step"], {"step": row["step"], "start": row["start_ns"], "end": row["end_ns"],
                                              "global_samples": None, "done": False})
        step["start"], step["end"] = min(step["start"], row["start_ns"]), max(step["end"], row["end_ns"])
        if row["is_boundary"]:
            step["global_samples"], step["done"] = row["global_samples"], True
    done = [s for s in sorted(steps.values(), key=lambda s: s["step"]) if s["done"]]
    ends = {s["step"]: s["end"] for s in done}
    return [{"step": s["step"], "step_ns": s["end"] - s["start"], "global_samples": s["global_samples"], "wall_ns": s["end"],
             "cycle_ns": s["end"] - ends[s["step"] - 1] if s["step"] - 1 in ends else s["end"] - s["start"]} for s in done]


def _at(step: int | None, samples) -> str:
    """Where a point is, in words: its step, else its global sample, else nothing."""
    if step is not None:
        return f" at step {step}"
    return f" at global sample {samples}" if samples is not None else ""


class AlarmEngine:
    """Rules evaluated point by point, with per-series trailing state; `fire` applies cooldown and `once`."""

    def __init__(self, rules: list[Rule], rank: int = 0, skip_steps=frozenset()):
        self.rules = rules
        self.rank = rank
        self.skip_steps = set(skip_steps)  # instrumented steps: the step rules neither judge nor remember them
        self.patterns = [re.compile(r.match) if r.match else None for r in rules]
        self.history: dict[tuple[int, str], deque] = {}
        self.first: dict[tuple[int, str], list] = {}  # memory_growth: the first `window` points
        self.last_fired: dict[tuple[int, str], int] = {}
        self.streak: dict[tuple[int, int], int] = {}  # straggler: (rule, rank) -> consecutive steps
        self.last_samples: int | None = None

    def fire(self, index: int, name: str, step: int | None, global_samples, value, threshold, wall_ns: int | None,
             detail: str, rank: int | None = None, baseline: float | None = None, score: float | None = None,
             position: int | None = None) -> list[dict]:
        """An alarm unless the rule's cooldown or `once` holds it back. Cooldown counts steps; a point with no
        step (a post-hoc series whose batch size is unknown) counts its `position` in the series instead."""
        rule, key = self.rules[index], (index, name)
        at = step if step is not None else position
        last = self.last_fired.get(key)
        if last is not None and (rule.once or at is None or at < last + rule.cooldown_steps):
            return []
        self.last_fired[key] = at
        return [{"rule": rule.kind, "name": name, "step": step, "global_samples": global_samples,
                 "value": None if value is None else float(value), "threshold": threshold, "severity": rule.severity,
                 "rank": self.rank if rank is None else rank, "wall_ns": wall_ns, "detail": detail,
                 "stop_training": rule.stop_training, "baseline": baseline, "score": score}]

    def trailing(self, index: int, name: str) -> deque:
        return self.history.setdefault((index, name), deque(maxlen=self.rules[index].window))

    # --- scalars ------------------------------------------------------------------------------------

    def scalar(self, name: str, step: int | None, global_samples, value: float, wall_ns: int | None,
               position: int | None = None) -> list[dict]:
        """One point of a scalar series, in series order (`position`: its index, for a point with no step)."""
        alarms = []
        for index, rule in enumerate(self.rules):
            pattern = self.patterns[index]
            if pattern is None or not pattern.search(name):
                continue
            where = (index, name, step, global_samples, wall_ns, position)
            if rule.kind in SCALAR_KINDS:
                alarms += self._scalar_rule(rule, value, *where)
            elif step in self.skip_steps:
                continue
            elif rule.kind == "slow_step" and math.isfinite(value):
                alarms += self._slow(rule, value, *where)
            elif rule.kind == "throughput_drop" and math.isfinite(value):
                alarms += self._throughput(rule, value, *where)
        return alarms

    def _scalar_rule(self, rule, value, index, name, step, samples, wall_ns, position) -> list[dict]:
        fire = lambda detail, **extra: self.fire(index, name, step, samples, value, rule.threshold, wall_ns,  # noqa: E731
                                                 detail, position=position, **extra)
        if rule.kind == "nonfinite":
            return [] if math.isfinite(value) else fire(f"{name} is {value}{_at(step, samples)}")
        if not math.isfinite(value):  # the trailing rules judge and keep finite points only
            return []
        if rule.kind == "grad_norm_high":
            if value <= rule.threshold:
                return []
            return fire(f"{name} = {value:.6g} > threshold {rule.threshold:g}{_at(step, samples)}")
        if rule.kind == "memory_growth":
            first = self.first.setdefault((index, name), [])
            if len(first) < rule.window:
                first.append(value)
                return []
            baseline = statistics.median(first)
            if baseline <= 0 or value <= baseline * (1 + rule.threshold):
                return []
            return fire(f"{name} = {value:.6g} is {value / baseline - 1:+.1%} over the median of its first "
                        f"{rule.window} points ({baseline:.6g}); limit +{rule.threshold:.0%}",
                        baseline=baseline, score=value / baseline - 1)
        history = self.trailing(index, name)  # loss_spike, grad_norm_spike
        alarms = []
        median = statistics.median(history) if history else None
        if (len(history) >= rule.min_history and (z := modified_z(value, list(history))) is not None and z > rule.threshold
                and median and abs(value / median - 1) >= rule.min_change):
            alarms = fire(f"{name} = {value:.6g} against a trailing median of {median:.6g} over {len(history)} "
                          f"points ({value / median - 1:+.1%}); robust z = {z:.1f} > {rule.threshold:g} (Iglewicz & "
                          "Hoaglin)", baseline=median, score=z)
        history.append(value)
        return alarms

    def _slow(self, rule, value, index, name, step, samples, wall_ns, position, describe=None,
              unit_scale: float = 1.0) -> list[dict]:
        """slow_step: `value` (a step time) above threshold x the trailing median of the series. The alarm's
        value and baseline are value x `unit_scale`; describe(median, points) words it (default: the scalar as
        logged)."""
        history = self.trailing(index, name)
        alarms = []
        if len(history) >= rule.min_history and (median := statistics.median(history)) > 0 and value > rule.threshold * median:
            detail = (describe(median, len(history)) if describe else
                      f"{name} = {value:.6g}{_at(step, samples)}, {value / median:.1f}x the trailing median of "
                      f"{median:.6g} over {len(history)} points")
            alarms = self.fire(index, name, step, samples, value * unit_scale, rule.threshold, wall_ns, detail,
                               position=position, baseline=median * unit_scale, score=value / median)
        history.append(value)
        return alarms

    # --- optimizer steps ---------------------------------------------------------------------------------

    def step(self, step: int, step_ns: int, global_samples, wall_ns: int) -> list[dict]:
        """One optimizer step of this rank, in step order."""
        alarms = []
        rate = None
        if global_samples is not None and self.last_samples is not None and step_ns > 0:
            rate = (global_samples - self.last_samples) / (step_ns / 1e9)
        self.last_samples = global_samples
        if step in self.skip_steps:
            return alarms
        for index, rule in enumerate(self.rules):
            where = (index, "step_time", step, global_samples, wall_ns, None)
            if rule.kind == "slow_step":
                alarms += self._slow(rule, step_ns, *where, unit_scale=1e-6,
                                     describe=lambda median, points: (
                                         f"step {step} took {step_ns / 1e6:.1f} ms, {step_ns / median:.1f}x the trailing "
                                         f"median of {median / 1e6:.1f} ms over {points} steps"))
            elif rule.kind == "throughput_drop" and rate is not None:
                alarms += self._throughput(rule, rate, index, "samples_per_s", step, global_samples, wall_ns, None)
        return alarms

    def _throughput(self, rule, rate, index, name, step, samples, wall_ns, position) -> list[dict]:
        """throughput_drop: the median of the last `recent` rates below (1 - threshold) x the median before them."""
        history = self.history.setdefault((index, name), deque(maxlen=rule.window + rule.recent))
        history.append(rate)
        if len(history) < rule.recent + max(rule.min_history, 1):
            return []
        points = list(history)
        recent, before = statistics.median(points[-rule.recent:]), statistics.median(points[:-rule.recent])
        if recent >= (1 - rule.threshold) * before:
            return []
        unit = " samples/s" if name == "samples_per_s" else ""
        return self.fire(index, name, step, samples, recent, rule.threshold, wall_ns,
                         f"{'' if unit else name + ': '}median {recent:.4g}{unit} over the last {rule.recent} "
                         f"{'steps' if unit else 'points'}, {recent / before - 1:+.1%} against {before:.4g} over the "
                         f"{len(points) - rule.recent} {'steps' if unit else 'points'} before",
                         position=position, baseline=before, score=recent / before - 1)

    # --- ranks and progress ----------------------------------------------------------------------------

    def ranks(self, step: int, busy_ns: dict[int, int], wall_ns: int) -> list[dict]:
        """One step every rank finished: busy time (step time minus comms time) per rank, in step order."""
        alarms = []
        for index, rule in enumerate(self.rules):
            if rule.kind != "straggler" or len(busy_ns) < 2:
                continue
            for rank, busy in busy_ns.items():
                others = statistics.median(v for r, v in busy_ns.items() if r != rank)
                slow = others > 0 and busy > rule.threshold * others
                streak = self.streak[(index, rank)] = self.streak.get((index, rank), 0) + 1 if slow else 0
                if streak >= rule.recent:
                    alarms += self.fire(index, f"rank {rank}", step, None, busy / 1e6, rule.threshold, wall_ns,
                                        f"rank {rank} busy {busy / 1e6:.1f} ms in step {step} (time since its previous step "
                                        f"minus comms), "
                                        f"{busy / others:.1f}x the other ranks' median {others / 1e6:.1f} ms, "
                                        f"{streak} steps running", rank=rank)
        return alarms

    def no_progress(self, last_step: int | None, last_samples, silent_s: float, wall_ns: int) -> list[dict]:
        """Called with the time since the last optimizer step ended (or since the start, before any)."""
        alarms = []
        for index, rule in enumerate(self.rules):
            if rule.kind == "no_progress" and silent_s > rule.threshold:
                step = -1 if last_step is None else last_step
                alarms += self.fire(index, "step_end", step + 1, last_samples, silent_s, rule.threshold, wall_ns,
                                    f"no optimizer step ended for {silent_s:.0f} s (limit {rule.threshold:g} s) "
                                    f"after step {step}")
        return alarms


# Profiler-schedule steps marked at most (a real schedule marks a handful; a damaged one could name billions)
MAX_SCHEDULE_MARKS = 100_000


def profiled_steps(schedule) -> list[tuple[int, str]]:
    """(optimizer step, profiler_warmup | profiler_window | profiler_export) for the collector's torch.profiler
    schedule (skip_first, wait, warmup, active, repeat; ProfilerStep#N is optimizer step N): the steps it traces
    and, after each window, the step in which every rank writes its trace. [] for a schedule that is not one."""
    fields = {"skip_first": 0, "wait": 0, "warmup": 0, "active": 1, "repeat": 1}
    if not isinstance(schedule, dict):
        return []
    fields = {key: schedule.get(key, default) for key, default in fields.items()}
    if not all(type(v) is int and 0 <= v <= MAX_STEP for v in fields.values()):
        return []
    first, wait, warmup, active = fields["skip_first"], fields["wait"], fields["warmup"], fields["active"]
    cycle = wait + warmup + active
    repeats = min(fields["repeat"], MAX_SCHEDULE_MARKS // max(cycle, 1) + 1)
    warmup, active = min(warmup, MAX_SCHEDULE_MARKS), min(active, MAX_SCHEDULE_MARKS)
    marks = []
    for repeat in range(repeats):
        start = first + repeat * cycle + wait
        marks += [(step, "profiler_warmup") for step in range(start, start + warmup)]
        marks += [(step, "profiler_window") for step in range(start + warmup, start + warmup + active)]
        marks.append((start + warmup + active, "profiler_export"))
    return marks


# A collector flushing at least this many steps apart has steps without a flush to compare with; flushing more often,
# its cost is in every step's time, and no step is set apart for it (by the step time, the alarms, the replay).
FLUSH_MARK_MIN_EVERY = 5


def flush_steps(first_flush_step, flush_every, last_step: int | None) -> range:
    """The optimizer steps during which the collector wrote a flush on its writer thread (the step after every
    flush_every-th one, from first_flush_step, which the collector notes, up to `last_step`); empty for values that
    are not whole step numbers, for a collector that noted no first flush, or one flushing more often than every
    FLUSH_MARK_MIN_EVERY steps."""
    if not (type(first_flush_step) is int and 0 <= first_flush_step <= MAX_STEP and type(flush_every) is int
            and flush_every >= FLUSH_MARK_MIN_EVERY and type(last_step) is int):
        return range(0)
    return range(first_flush_step, min(last_step, MAX_STEP) + 1, flush_every)


def replay(rules: list[Rule], scalars: list[dict], steps_by_rank: dict[int, list[dict]],
           comms_by_rank: dict[int, list[dict]], rank: int = 0, skip_steps=frozenset()) -> list[dict]:
    """The rules over recorded rows, as the job evaluated them: `scalars` (rank `rank`'s collector scalars, in
    the order written), train_steps and comms_calls rows per rank, with the step rules skipping `skip_steps`.
    no_progress is judged on the gaps between consecutive step ends (the watchdog's view of a hang that ended)."""
    engine = AlarmEngine(rules, rank, skip_steps)
    alarms = []
    for row in scalars:
        alarms += engine.scalar(row["name"], row["step"], row["global_samples"], row["value"], row["wall_ns"])
    own = step_times(steps_by_rank.get(rank, []))
    previous = None
    for step in own:
        if previous is not None:
            silent_s = (step["wall_ns"] - previous["wall_ns"]) / 1e9
            alarms += engine.no_progress(previous["step"], previous["global_samples"], silent_s, step["wall_ns"])
        previous = step
        alarms += engine.step(step["step"], step["step_ns"], step["global_samples"], step["wall_ns"])
    for step, busy, wall in busy_steps(steps_by_rank, comms_by_rank):
        alarms += engine.ranks(step, busy, wall)
    return alarms


def busy_steps(steps_by_rank: dict[int, list[dict]], comms_by_rank: dict[int, list[dict]], after: int = -1):
    """(step, {rank: busy ns}, wall_ns) for each step after `after` that every rank finished, in step order."""
    per_rank = {}
    for rank, rows in steps_by_rank.items():
        comms: dict[int, int] = {}
        for call in comms_by_rank.get(rank, []):
            if call["step"] is not None and call["latency_ns"] is not None:
                comms[call["step"]] = comms.get(call["step"], 0) + call["latency_ns"]
        per_rank[rank] = {s["step"]: (s["cycle_ns"] - comms.get(s["step"], 0), s["wall_ns"]) for s in step_times(rows)}
    if len(per_rank) < 2:
        return []
    common = set.intersection(*(set(steps) for steps in per_rank.values()))
    return [(step, {rank: per_rank[rank][step][0] for rank in per_rank}, max(v[step][1] for v in per_rank.values()))
            for step in sorted(common) if step > after]
