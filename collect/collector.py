"""The collector: hooks on a DeepSpeed engine (or a plain torch model and optimizer) that record steps,
timers, monitor scalars, comms calls, one FLOPs profile and bounded torch.profiler windows of one rank.

Safety: every hook runs inside `guard(part, ...)`. An exception there is logged once, disables that part
(recorded in the manifest) and never reaches the training loop; the wrapped engine call always runs. `attach`
itself never raises: a collector that cannot start (a read-only run folder, bad settings) logs why once and
returns an `InactiveCollector`, whose calls do nothing. A failed writer drops (and counts) rows instead of
buffering them; a `log()` value that is not a number, or a name that is not text, is dropped and counted (NaN and
inf are kept). A second `attach` on one engine or model returns the collector already attached. On SIGTERM
(how schedulers stop jobs) the collector flushes, marks the manifest `terminated` and then does what the
handler it replaced would have done.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

from steplens.analyze.contract import alarm_rules, layout
from steplens.analyze.contract.bus_bandwidth import with_bandwidth

from . import environment, model_shape
from .comms import CommsRecorder
from .parts import PartWriter

log = logging.getLogger("steplens.collect")

TABLES = ("train_steps", "step_timers", "scalars", "comms_calls", "flops_profile", "alarms")
SOURCE = "collector"
# The collector attached to each engine or model, while it is. Not an attribute of theirs: copy.deepcopy(model) (an
# EMA copy) would try to copy the collector's threads and locks.
_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ABSENT = object()


def as_number(value) -> float | None:
    """A scalar's value as a float (NaN and inf included: alarms watch for them), or None for what is not a
    number at all: text, None, containers, a tensor of several elements."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float range is still a number
        try:
            return math.inf if value > 0 else -math.inf
        except Exception:  # an object whose __float__ overflows and that cannot be compared: not a number
            return None
    except Exception:  # TypeError, ValueError, a tensor of several elements (RuntimeError), a broken __float__
        return None


def _is_name(name) -> bool:
    """A scalar name the Parquet parts can hold: text that encodes as UTF-8 (no lone surrogate)."""
    if not isinstance(name, str):
        return False
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Settings:
    """The `steplens` block of a ds_config, or the dict given to `attach`."""

    run_dir: str = "."  # collector/ and traces/ are written here
    flush_every: int = 50  # optimizer steps between flushes (and at exit)
    seq_len: int | None = None  # tokens per sample: gives global_tokens
    flops_step: int | None = None  # optimizer step whose first forward is FLOPs-profiled (rank 0)
    profile: dict | None = None  # torch.profiler schedule: skip_first, wait, warmup, active, repeat (>= 1)
    profile_with_stack: bool = False
    profile_with_modules: bool = False  # module hierarchy in the profiler window (with_modules)
    # Release CUPTI after each profiler window (PyTorch's TEARDOWN_CUPTI=1); None: yes, unless the job sets
    # TEARDOWN_CUPTI itself or uses CUDA graphs. Left attached, CUPTI slowed every later step of a real
    # H200 ZeRO-3 job by ~45% (pytorch/pytorch#144455).
    cupti_teardown: bool | None = None
    model_layers: int | None = None  # the model's transformer layers and hidden size, for the analytic MFU
    model_hidden: int | None = None  # numerator, where the model's config or structure does not give them
    comms: bool = True  # one record per deepspeed.comm call
    comms_synchronize: bool = True  # wait for async / device-queued ops so the latency covers the transfer
    scalars_all_ranks: bool = False  # scalars from every rank, not only rank 0
    samples_per_step: int | None = None  # plain torch only: global samples per optimizer step
    alarms: list | None = None  # alarm rules (analyze/contract/alarm_rules.py); None: the default rules, []: none
    pushgateway: str | None = None  # "host:port" of a Prometheus pushgateway alarms are pushed to
    alarm_timeout_s: float = 5.0  # an alarm sink slower than this is disabled; also the wait for them at close

    @classmethod
    def parse(cls, config: dict | None) -> Settings:
        config = dict(config or {})
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := set(config) - known:
            raise ValueError(f"steplens collector: unknown settings {sorted(unknown)}; known: {sorted(known)}")
        settings = cls(**config)
        if settings.flush_every < 1:
            raise ValueError("steplens collector: flush_every must be >= 1")
        if settings.profile is not None:
            schedule = {"skip_first": 0, "wait": 0, "warmup": 1, "active": 1, "repeat": 1, **settings.profile}
            if set(schedule) != {"skip_first", "wait", "warmup", "active", "repeat"}:
                raise ValueError(f"steplens collector: profile keys are skip_first, wait, warmup, active, repeat; got {sorted(settings.profile)}")
            if schedule["repeat"] < 1 or schedule["active"] < 1:
                raise ValueError("steplens collector: profile windows must be bounded (repeat >= 1, active >= 1)")
            settings = dataclasses.replace(settings, profile=schedule)
        alarm_rules.parse_rules(settings.alarms)  # raises on a bad rule
        if settings.alarm_timeout_s <= 0:
            raise ValueError("steplens collector: alarm_timeout_s must be > 0")
        return settings


class Collector:
    """What both forms share: output, manifest, guard, scalars, profiler windows, comms."""

    def __init__(self, settings: Settings, rank: int, world_size: int):
        self.settings = settings
        self.rank = rank
        self.world_size = world_size
        self.run_dir = Path(settings.run_dir).resolve()
        self.writer = PartWriter(self.run_dir, rank, TABLES, prepare={"comms_calls": with_bandwidth})
        self.disabled: dict[str, str] = {}
        self.step = 0  # optimizer step in progress
        self.completed_steps = 0
        self.call_index = 0
        self.flags: dict[str, str] = {}
        self.run_facts: dict = {}
        self.flops_step = settings.flops_step
        self.profiler = None
        self.profiler_steps_left = 0
        self.profiler_facts: dict = {}  # what the collector did about the profiler's own cost (manifest "profiler")
        self.comms = None
        self.restore: list[tuple[object, str, object]] = []  # (owner, attribute, value before) for close
        self.started_ns = time.time_ns()
        self.status = "running"
        self.closed = False
        self.host: dict = {}
        self.rejected_values: dict[str, int] = {}  # log() values that are not numbers, per scalar name
        self.sigterm_previous = None  # the SIGTERM handler ours replaced, while ours is installed
        self.terminating = False
        self.sigterm_deferred = False  # a SIGTERM that came while close() was finishing: handed on after it
        self.on_alarm = None  # attach's callback
        self.alarms = None  # rank 0's Alarms, when rules are on
        self.stop_requested = False  # an alarm asked the job to stop (stop_training); the job decides
        self.last_step_end: float | None = None  # time.monotonic() at the end of the last optimizer step
        self.samples_at_last_step: int | None = None
        self.owner_pid = os.getpid()  # a forked child inherits this object but not its writer thread

    # --- safety -------------------------------------------------------------------------------

    def active(self, part: str) -> bool:
        return part not in self.disabled

    def guard(self, part: str, fn, *args):
        """fn(*args), or None; a failure disables `part` for the rest of the job."""
        if part in self.disabled:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            self.disable(part, f"{type(exc).__name__}: {exc}", exc_info=True)
            return None

    def disable(self, part: str, reason: str, exc_info: bool = False) -> None:
        self.disabled[part] = reason
        # One line: a traceback in the job's log reads as the job's own crash (analyze took a job that exited 0
        # for a failed one); where it failed is logged at debug level. A writer that stops says so itself, once.
        if part == "writer":
            self.writer.fail(reason, {})  # nothing is buffered from here on
        else:
            log.warning("steplens collector: %s disabled on rank %d after %s", part, self.rank, reason)
        if exc_info:
            log.debug("steplens collector: where %s failed", part, exc_info=True)

    # --- rows -----------------------------------------------------------------------------------

    def device_memory_peaks(self) -> dict:
        """The device's peak allocated/reserved bytes for a train_steps row; {} while the job has not initialized
        CUDA/ROCm (a CPU run: no cuda call at all, and never a context created on an unused GPU). One
        memory_stats() read, which does not synchronize; the peak is never reset, since the job's own
        max_memory_allocated() readings (DeepSpeed's, Megatron's, the user's) would change."""
        import torch

        if not torch.cuda.is_initialized():
            return {}
        stats = torch.cuda.memory_stats()
        return {"max_allocated_bytes": stats.get("allocated_bytes.all.peak"),
                "max_reserved_bytes": stats.get("reserved_bytes.all.peak")}

    def tokens(self, samples: int | None) -> int | None:
        return samples * self.settings.seq_len if samples is not None and self.settings.seq_len else None

    def writes_scalars(self) -> bool:
        return self.rank == 0 or self.settings.scalars_all_ranks

    def add_scalar(self, name: str, value, step: int | None, samples: int | None) -> None:
        """One point; a value that is not a number at all, or a name that is not text, costs this point only
        (counted by name: the scalars table and the alarms key their series by a string)."""
        number = as_number(value)
        if number is None or not _is_name(name):
            # Counted under the name, or under its type: bad names (log(step, x) in a loop) must not grow the manifest.
            key = name if _is_name(name) else f"<name of type {type(name).__name__}>"
            if key not in self.rejected_values:
                what = "not a number" if _is_name(name) else "logged under a name that is not UTF-8 text"
                log.warning("steplens collector: %.80s = %.80r is %s; such points are dropped and counted "
                            "in the manifest (rejected_values)", key, value, what)
            self.rejected_values[key] = self.rejected_values.get(key, 0) + 1
            return
        self.writer.add("scalars", {
            "rank": self.rank, "source": SOURCE, "origin": "collector", "name": name, "step": step,
            "global_samples": samples, "global_tokens": self.tokens(samples), "value": number,
            "wall_ns": time.time_ns(),
        })

    def log(self, name: str, value: float) -> None:
        """A user scalar (train/loss, train/grad_norm, perf/step_time, mem/peak, ...) at the last finished step."""
        if self.writes_scalars():
            self.guard("scalars", self.add_scalar, name, value, self.last_finished_step(), self.samples_now())

    def samples_now(self) -> int | None:
        raise NotImplementedError

    def record_comm(self, row: dict) -> None:
        row.update(rank=self.rank, source=SOURCE, call_index=self.call_index, step=self.step)
        self.call_index += 1
        self.writer.add("comms_calls", row)

    def add_flops(self, rows: list[dict]) -> None:
        for row in rows:
            self.writer.add("flops_profile", {"rank": self.rank, "source": SOURCE, "profile_step": self.step, **row})

    # --- windows and flushes ----------------------------------------------------------------------

    def uses_cuda_graphs(self) -> str | None:
        """Why the job may replay CUDA graphs (CUPTI teardown then crashes on re-init, PyTorch's FIXME in
        torch/profiler/profiler.py), or None."""
        inductor = sys.modules.get("torch._inductor.config")
        if inductor is not None and getattr(getattr(inductor, "triton", None), "cudagraphs", False):
            return "torch.compile with CUDA graphs (inductor triton.cudagraphs)"
        return None

    def release_cupti(self) -> None:
        """Arrange for Kineto to release CUPTI after each window: it reads TEARDOWN_CUPTI at every teardown.
        torch.compile(mode="reduce-overhead") sets TEARDOWN_CUPTI=0 itself (CUDA graphs), which is kept."""
        import torch

        if not torch.cuda.is_available():
            self.profiler_facts = {"cupti_teardown": None, "cupti_teardown_by": "no CUDA device: no CUPTI"}
            return
        graphs = self.uses_cuda_graphs()
        if "TEARDOWN_CUPTI" in os.environ:
            decided = (os.environ["TEARDOWN_CUPTI"] == "1", "the job's environment (TEARDOWN_CUPTI)")
        elif self.settings.cupti_teardown is not None:
            decided = (self.settings.cupti_teardown, "the collector's cupti_teardown setting")
        elif graphs:
            decided = (False, f"left attached: the job uses CUDA graphs ({graphs}), which crash on CUPTI re-init")
        else:
            decided = (True, "the collector (TEARDOWN_CUPTI=1)")
        if decided[0] and "TEARDOWN_CUPTI" not in os.environ:
            os.environ["TEARDOWN_CUPTI"] = "1"
        self.profiler_facts = {"cupti_teardown": decided[0], "cupti_teardown_by": decided[1], "cuda_graphs": graphs}
        if not decided[0]:
            log.warning("steplens collector: CUPTI stays attached after the profiler windows (%s): later steps may "
                        "run slower; analyze measures it (profiler_after_effect)", decided[1])

    def start_profiler(self) -> None:
        import torch
        import torch.profiler as tp

        schedule = self.settings.profile
        activities = [tp.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(tp.ProfilerActivity.CUDA)
        self.release_cupti()
        traces = self.run_dir / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        self.profiler = tp.profile(
            activities=activities, record_shapes=True, with_stack=self.settings.profile_with_stack,
            with_modules=self.settings.profile_with_modules,
            schedule=tp.schedule(**schedule),
            # Standard gzipped Kineto JSON: rank<r>.<ns>.pt.trace.json.gz, read by analyze and Perfetto.
            on_trace_ready=tp.tensorboard_trace_handler(str(traces), worker_name=f"rank{self.rank}", use_gzip=True),
        )
        # ProfilerStep#N counts prof.step() calls from here, so N is the optimizer step.
        self.profiler.start()
        self.profiler_steps_left = schedule["skip_first"] + (
            schedule["wait"] + schedule["warmup"] + schedule["active"]) * schedule["repeat"]

    def profiler_step(self) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        self.profiler_steps_left -= 1
        if self.profiler_steps_left <= 0:  # past the last window: detach, no cost from here on
            self.stop_profiler()

    def stop_profiler(self) -> None:
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.stop()

    def step_finished(self) -> None:
        """After each optimizer step: profiler schedule, periodic flush."""
        self.completed_steps += 1
        self.last_step_end = time.monotonic()
        self.samples_at_last_step = self.guard("alarms", self.samples_now)
        self.guard("profiler", self.profiler_step)
        if self.completed_steps % self.settings.flush_every == 0:
            self.guard("writer", self.flush_between_steps)

    def next_step(self) -> int:
        """The number the next optimizer step's rows will carry."""
        return self.completed_steps

    def flush_between_steps(self) -> None:
        """The periodic flush: its write runs on the writer thread during the next step, whose time (on a machine
        with few cores) holds some of it. The run fact first_flush_step says which step that was (the others follow
        every flush_every steps: analyze leaves them out of the step time), and the alarms' step rules skip them."""
        step = self.next_step()
        self.run_facts.setdefault("first_flush_step", step)
        if self.alarms is not None and step in alarm_rules.flush_steps(
                self.run_facts["first_flush_step"], self.settings.flush_every, step):
            self.alarms.engine.skip_steps.add(step)
        self.flush()

    def last_finished_step(self) -> int | None:
        """The last optimizer step finished; None before the first (not -1, which no step is)."""
        return self.completed_steps - 1 if self.completed_steps else None

    def flush(self, background: bool = True) -> None:
        # The lists handed to the writer are replaced, not changed, after this: the alarms read them as they are.
        rows = [self.writer.rows[table] for table in ("scalars", "train_steps", "comms_calls")]
        # the step this flush covers: the manifests say so once its parts are written (PartWriter.flushed_step)
        self.writer.flush({**self.manifest(), "last_flushed_step": self.last_finished_step()}, background)
        if self.alarms is not None:
            self.writer.run(self.guard, "alarms", self.alarms.evaluate, *rows, background=background)
        if self.writer.failure is not None and "writer" not in self.disabled:  # a background write failed
            self.disable("writer", self.writer.failure)

    # --- manifest -----------------------------------------------------------------------------------

    def base_facts(self) -> dict:
        return {
            "world_size": self.world_size,
            "environment": environment.versions(),
            "git": environment.git_revision(environment.training_script_dir()),
            "settings": dataclasses.asdict(self.settings),
        }

    def manifest(self) -> dict:
        return {
            "format": layout.COLLECTOR_MANIFEST_FORMAT, "version": layout.COLLECTOR_MANIFEST_VERSION, "rank": self.rank,
            "status": self.status,
            "started_ns": self.started_ns, "updated_ns": time.time_ns(),
            "steps_completed": self.completed_steps, "last_flushed_step": self.writer.flushed_step,
            "flushes": self.writer.seq, "rows_written": dict(self.writer.rows_written),
            "dropped_rows": dict(self.writer.dropped_rows), "rejected_values": dict(self.rejected_values),
            "disabled": dict(self.disabled), "flags": self.flags, "host": self.host, "run": self.run_facts,
            "alarms": None if self.alarms is None else self.alarms.summary(), "profiler": self.profiler_facts,
        }

    def write_manifest(self) -> None:
        self.writer.write_manifest(self.manifest())

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self.run_facts = self.guard("manifest", self.base_facts) or {}
        self.host = self.guard("manifest", environment.describe_host) or {}
        self.write_manifest()  # a run folder that cannot take even the manifest: attach gives up, the job goes on
        self.guard("writer", self.writer.warm_up)
        if self.settings.profile is not None and self.writer.folder_lock.other_writer is None:  # (its traces too)
            self.guard("profiler", self.start_profiler)
        atexit.register(self.close_at_exit)
        self.guard("sigterm", self.install_sigterm)
        rules = alarm_rules.parse_rules(self.settings.alarms)
        if self.rank == 0 and rules:
            from .alarms import Alarms

            self.alarms = self.guard("alarms", Alarms, self, rules, self.on_alarm)
        previous_hook = sys.excepthook

        def note_crash(kind, value, traceback):  # an uncaught exception ends the job: the manifest says failed
            self.status = "failed"
            previous_hook(kind, value, traceback)

        self.wrap(sys, "excepthook", note_crash)

    def wrap(self, owner, name: str, replacement) -> None:
        """Set owner.name (a method is shadowed by an instance attribute); close() puts back what was there."""
        self.restore.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, replacement)

    # --- SIGTERM ---------------------------------------------------------------------------------------

    def install_sigterm(self) -> None:
        """Ours in front of the current SIGTERM handler; only from the main thread (Python's rule) and not when
        the job ignores SIGTERM or a handler outside Python is set (we could not pass the signal on)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:
            return
        self.sigterm_previous = previous
        signal.signal(signal.SIGTERM, self.on_sigterm)

    def restore_sigterm(self) -> None:
        previous, self.sigterm_previous = self.sigterm_previous, None
        # Only if ours is still the handler: one installed after ours (and chaining to it) stays.
        if previous is not None and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) == self.on_sigterm:
            signal.signal(signal.SIGTERM, previous)

    def on_sigterm(self, signum, frame) -> None:
        """Flush and mark the manifest `terminated`, then what the previous handler does (the default: die
        by SIGTERM, as the job would have without us)."""
        previous = self.sigterm_previous or signal.SIG_DFL
        if self.closed and os.getpid() == self.owner_pid:
            # close() is flushing the last steps (the handler stays until it is done): it hands the signal on
            # afterwards, as a SIGTERM during its last flush lost every unflushed step.
            self.sigterm_deferred = True
            self.status = "terminated"
            return
        # A second SIGTERM during our flush is not run twice; a forked child's is not ours to handle.
        if not self.terminating and not self.closed and os.getpid() == self.owner_pid:
            self.terminating = True
            self.status = "terminated"
            self.guard("writer", self.flush, False)
            self.guard("manifest", self.write_manifest)  # the status, even when the flush failed
        _hand_on(previous, signum, frame)

    # --- lifecycle (end) ----------------------------------------------------------------------------------

    def unhook(self, keep_sigterm: bool = False) -> None:
        """Put back everything attach changed in the job; no writes. With keep_sigterm, the SIGTERM handler stays
        (close() puts it back once its last flush is done)."""
        self.guard("profiler", self.stop_profiler)
        if self.comms is not None:
            self.guard("comms", self.comms.uninstall)
        for owner, name, before in reversed(self.restore):
            if before is _ABSENT:
                vars(owner).pop(name, None)
            else:
                setattr(owner, name, before)
        self.restore.clear()
        if not keep_sigterm:
            self.guard("sigterm", self.restore_sigterm)
        atexit.unregister(self.close_at_exit)
        for target in [target for target, collector in _ATTACHED.items() if collector is self]:
            del _ATTACHED[target]  # (the entry would keep the model alive)
        if self.alarms is not None:
            self.alarms.stop.set()  # the watchdog: a job that has stopped stepping is not a hang

    def close(self, status: str = "completed") -> None:
        """Flush what is buffered, stop profiling, unhook, and mark the manifest finished. Idempotent; never raises."""
        if self.closed:
            return
        self.closed = True
        self.guard("unhook", self.unhook, True)
        if self.status == "running":
            self.status = status
        self.guard("writer", self.flush, False)  # with the last alarm evaluation
        if self.alarms is not None:
            self.guard("alarms", self.alarms.close)  # pending alarms delivered (bounded) before close returns
        self.guard("writer", self.writer.close)
        self.guard("manifest", self.write_manifest)  # the final status, even when the last flush failed
        previous = self.sigterm_previous or signal.SIG_DFL
        self.guard("sigterm", self.restore_sigterm)
        if self.sigterm_deferred:  # a SIGTERM came during the above: now what the job would have done with it
            _hand_on(previous, signal.SIGTERM, None)

    def close_at_exit(self) -> None:
        if os.getpid() != self.owner_pid:  # a forked child exiting: the parent's collector is not its to close
            return
        self.close(status="completed" if self.status == "running" else self.status)


class EngineCollector(Collector):
    """Hooks on an initialized DeepSpeed engine."""

    def __init__(self, engine, settings: Settings):
        super().__init__(settings, rank=engine.global_rank, world_size=engine.world_size)
        self.engine = engine
        self.micro_start_ns = 0
        self.micro_step = 0
        self.micros_since_boundary = 0
        self.timer_line = 0
        self.samples_per_micro = engine.train_micro_batch_size_per_gpu() * engine.dp_world_size

    def samples_now(self) -> int:
        return self.engine.global_samples

    def run_description(self) -> dict:
        e = self.engine
        dtype = "bf16" if e.bfloat16_enabled() else "fp16" if e.fp16_enabled() else "fp32"
        config = getattr(e._config, "_param_dict", None) or e.config
        return {
            "zero_stage": e.zero_optimization_stage(), "dtype": dtype, "dp_world_size": e.dp_world_size,
            "micro_batch": e.train_micro_batch_size_per_gpu(), "grad_accum": e.gradient_accumulation_steps(),
            "train_batch_size": e.train_batch_size(), "seq_len": self.settings.seq_len,
            "param_count": sum(getattr(p, "ds_numel", p.numel()) for p in e.module.parameters()),
            "model_shape": self.guard("manifest", model_shape.describe, e.module, self.settings.model_layers,
                                      self.settings.model_hidden),
            "ds_config": config, "wall_clock_breakdown": bool(e.wall_clock_breakdown()),
        }

    def base_facts(self) -> dict:
        return {**super().base_facts(), **self.run_description()}

    def note_profiler_pitfalls(self) -> None:
        e = self.engine
        if e.flops_profiler_enabled():
            self.flags["engine_flops_profiler_root_latency_bogus"] = (
                "DeepSpeed's own flops profiler is on: its root-module latency is bogus (started inside the root's "
                "forward pre-hook) and every '% latency' is 0; the collector's flops_profile table is not affected")
            if self.flops_step == e.flops_profiler_profile_step():
                self.flops_step += 1
                self.flags["flops_step_moved"] = (
                    f"flops_step moved to {self.flops_step}: DeepSpeed's profiler runs on step {self.flops_step - 1} "
                    "and two profilers on one forward would count every op twice")
        if self.flops_step is not None and e.zero_optimization_stage() == 3:
            self.flags["flops_zero3_double_counting"] = (
                "ZeRO-3: the FLOPs profiler counts Linear MACs twice (ZeRO-3's linear wrapper and F.linear both "
                "patched), so macs/flops of Linear modules and their parents are about 2x")

    def attach(self) -> None:
        e = self.engine
        self.guard("manifest", self.note_profiler_pitfalls)
        self.wrap(e, "forward", self.wrapped_forward(e.forward))
        self.wrap(e, "step", self.wrapped_step(e.step))
        if callable(getattr(e, "save_checkpoint", None)):
            self.wrap(e, "save_checkpoint", self.wrapped_save_checkpoint(e.save_checkpoint))
        if hasattr(e.timers, "timers"):  # a NoopTimer (wall_clock_breakdown off) has nothing to read
            self.wrap(e.timers, "log", self.wrapped_timer_log(e.timers.log))
        from .monitor import SteplensMonitor

        self.wrap(e.monitor, "write_events", self.wrapped_write_events(e.monitor.write_events, SteplensMonitor(self)))
        if not e.monitor.enabled:
            # With no monitor configured the engine builds no events; this makes it build them for us.
            self.wrap(e.monitor, "enabled", True)
        if self.settings.comms:
            self.comms = self.guard("comms", CommsRecorder, self, self.settings.comms_synchronize)
            if self.comms is not None:
                self.guard("comms", self.comms.install)
        self.start()

    # --- engine hooks ---------------------------------------------------------------------------------

    def wrapped_forward(self, forward):
        def forward_recorded(*args, **kwargs):
            self.guard("steps", self.micro_started)
            capture = self.guard("flops", self.flops_begin)
            try:
                return forward(*args, **kwargs)
            finally:
                if capture is not None:
                    self.guard("flops", self.flops_end, capture)
        return forward_recorded

    def wrapped_step(self, step):
        def step_recorded(*args, **kwargs):
            boundary = self.engine.is_gradient_accumulation_boundary()  # the engine's own answer; step() asks too
            skipped_before = self.engine.skipped_steps
            result = step(*args, **kwargs)
            self.guard("steps", self.micro_finished, boundary, skipped_before)
            if boundary:
                self.step_finished()
            return result
        return step_recorded

    def wrapped_save_checkpoint(self, save_checkpoint):
        """Note the step a checkpoint save precedes (run fact checkpoint_steps: engine.global_steps when the save
        began, the `step` of the next train_steps rows, DeepSpeed's global_step<N> tag); the save itself is
        untouched, and a failure to note it costs the note only."""
        def save_recorded(*args, **kwargs):
            self.guard("checkpoint", self.checkpoint_started)
            return save_checkpoint(*args, **kwargs)
        return save_recorded

    def next_step(self) -> int:
        return int(self.engine.global_steps)  # a resumed job's steps go on from its checkpoint's

    def checkpoint_started(self) -> None:
        step = self.next_step()  # the step the save precedes: its time holds the save's wait
        self.run_facts.setdefault("checkpoint_steps", []).append(step)
        if self.alarms is not None:
            self.alarms.engine.skip_steps.add(step)

    def wrapped_timer_log(self, timer_log):
        def log_recorded(names, *args, **kwargs):
            self.guard("timers", self.record_timers, names)
            return timer_log(names, *args, **kwargs)
        return log_recorded

    def wrapped_write_events(self, write_events, backend):
        def write_events_to_all(event_list):
            backend.write_events(event_list)
            return write_events(event_list)
        return write_events_to_all

    def micro_started(self) -> None:
        self.micro_start_ns = time.time_ns()
        self.step = self.engine.global_steps
        self.micro_step = self.engine.micro_steps

    def micro_finished(self, boundary: bool, skipped_before: int) -> None:
        e = self.engine
        end = time.time_ns()
        self.micros_since_boundary = 0 if boundary else self.micros_since_boundary + 1
        # The engine counts samples at the boundary only; between, add this step's micro batches so far.
        samples = e.global_samples + self.micros_since_boundary * self.samples_per_micro
        scale = e._get_optimizer_loss_scale() if e.fp16_enabled() else None
        lr = e.get_lr()
        self.writer.add("train_steps", {
            "rank": self.rank, "source": SOURCE, "step": self.step, "micro_step": self.micro_step,
            "start_ns": self.micro_start_ns, "end_ns": end, "dur_ns": end - self.micro_start_ns,
            "is_boundary": boundary, "skipped": e.skipped_steps > skipped_before if boundary else None,
            "global_samples": samples, "global_tokens": self.tokens(samples),
            "loss_scale": None if scale is None else float(scale), "lr": float(lr[0]) if lr else None,
            **(self.guard("memory", self.device_memory_peaks) or {}),
        })

    def record_timers(self, names) -> None:
        timers, engine_timers = self.engine.timers, self.engine.engine_timers
        micro, global_ = set(engine_timers.micro_timers), set(engine_timers.global_timers)
        line = self.timer_line
        self.timer_line += 1
        for name in names:
            if name in timers.timers:
                scope = "micro" if name in micro else "global" if name in global_ else "optimizer"
                self.writer.add("step_timers", {
                    "rank": self.rank, "source": SOURCE, "step": self.step, "line": line, "scope": scope,
                    "timer": name, "ms": float(timers.timers[name].elapsed(reset=False)),
                })

    def record_events(self, event_list) -> None:
        if self.writes_scalars():
            for name, value, samples in event_list:
                self.add_scalar(name, value, self.step, int(samples))

    def flops_begin(self):
        """A FLOPs capture around the first forward of flops_step (rank 0), else None."""
        due = (self.flops_step is not None and self.rank == 0 and self.engine.global_steps == self.flops_step
               and self.micros_since_boundary == 0)
        if not due:
            return None
        from .flops import FlopsCapture

        self.flops_step = None  # one profile per job
        return FlopsCapture(self.engine.module)

    def flops_end(self, capture) -> None:
        self.add_flops(capture.finish())


class TorchCollector(Collector):
    """Reduced form for a plain torch model and optimizer: one train_steps row per optimizer step (from the
    first forward after the previous step to the end of optimizer.step()), scalars, FLOPs, profiler windows."""

    def __init__(self, model, optimizer, settings: Settings):
        rank, world_size = 0, 1
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        super().__init__(settings, rank=rank, world_size=world_size)
        self.model = model
        self.optimizer = optimizer
        self.step_start_ns = None
        self.micro_steps = 0
        self.capture = None
        self.handles = []

    def samples_now(self) -> int | None:
        per_step = self.settings.samples_per_step
        return per_step * self.completed_steps if per_step else None

    def attach(self) -> None:
        self.run_facts_extra = {
            "param_count": sum(p.numel() for p in self.model.parameters()), "seq_len": self.settings.seq_len,
            "model_shape": self.guard("manifest", model_shape.describe, self.model, self.settings.model_layers,
                                      self.settings.model_hidden),
            "train_batch_size": self.settings.samples_per_step,
        }
        self.handles = [
            self.model.register_forward_pre_hook(lambda module, args: self.guard("steps", self.forward_started)),
            self.optimizer.register_step_post_hook(lambda opt, args, kwargs: self.optimizer_stepped()),
        ]
        self.start()

    def base_facts(self) -> dict:
        return {**super().base_facts(), **self.run_facts_extra}

    def forward_started(self) -> None:
        if self.step_start_ns is None:
            self.step_start_ns = time.time_ns()
        self.micro_steps += 1
        if self.flops_step == self.completed_steps and self.rank == 0 and self.capture is None:
            from .flops import FlopsCapture

            self.flops_step = None
            self.capture = self.guard("flops", FlopsCapture, self.model)
            if self.capture is not None:
                # Registered after the profiler's own hooks, so it runs after them (the root's duration is set).
                self.handles.append(self.model.register_forward_hook(
                    lambda module, args, out: self.guard("flops", self.forward_profiled)))

    def forward_profiled(self) -> None:
        capture, self.capture = self.capture, None
        self.handles.pop().remove()  # one profile per job
        if capture is not None:
            self.add_flops(capture.finish())

    def optimizer_stepped(self) -> None:
        self.guard("steps", self.record_step)
        self.step_finished()
        self.step = self.completed_steps

    def record_step(self) -> None:
        end = time.time_ns()
        start = self.step_start_ns or end
        self.step_start_ns = None
        per_step = self.settings.samples_per_step
        samples = per_step * (self.completed_steps + 1) if per_step else None
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
        self.writer.add("train_steps", {
            "rank": self.rank, "source": SOURCE, "step": self.completed_steps, "micro_step": self.micro_steps - 1,
            "start_ns": start, "end_ns": end, "dur_ns": end - start, "is_boundary": True, "skipped": False,
            "global_samples": samples, "global_tokens": self.tokens(samples),
            "lr": None if lr is None else float(lr),
            **(self.guard("memory", self.device_memory_peaks) or {}),
        })

    def unhook(self, keep_sigterm: bool = False) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        super().unhook(keep_sigterm)


def _hand_on(previous, signum, frame) -> None:
    """What the SIGTERM handler ours replaced does: call it, or (the default) die by SIGTERM as without us."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _attached_to(target) -> Collector | None:
    try:
        return _ATTACHED.get(target)
    except TypeError:  # not weakly referenceable, or unhashable
        return None


class InactiveCollector:
    """What `attach` returns when the collector could not start: the same calls, doing nothing."""

    def __init__(self, reason: str):
        self.reason = reason
        self.status = "inactive"
        self.disabled = {"collector": reason}
        self.stop_requested = False

    def log(self, name: str, value) -> None:
        pass

    def close(self, status: str = "completed") -> None:
        pass


def attach(target, config: dict | None = None, optimizer=None, on_alarm=None, **settings) -> Collector | InactiveCollector:
    """Start collecting on a DeepSpeed engine, or on a plain torch model with its optimizer.

    Settings come from `config`, else from the engine's ds_config block "steplens" (see `Settings`); keyword
    arguments override single settings of either. `on_alarm(alarm: dict)` is called (on its own thread) for
    every alarm on rank 0. Returns the collector: `collector.log(name, value)` for user scalars and
    `collector.close()` at the end (also run at exit). Never raises: when the collector cannot start (bad
    settings, a run folder it cannot write) the reason is logged once and an `InactiveCollector` comes back.
    """
    collector = None
    try:
        if (attached := _attached_to(target)) is not None and not attached.closed:
            # Two collectors on one engine would write the same part names and manifest.
            log.warning("steplens collector: already attached to this %s; the first collector is returned "
                        "(its settings stay)", type(target).__name__)
            return attached
        is_engine = hasattr(target, "is_gradient_accumulation_boundary") and hasattr(target, "global_steps")
        if config is None and is_engine:
            ds_config = getattr(target._config, "_param_dict", None) or {}
            config = ds_config.get("steplens", {})
        parsed = Settings.parse({**(config or {}), **settings})
        if is_engine:
            collector = EngineCollector(target, parsed)
        else:
            if optimizer is None:
                raise ValueError("a plain torch model needs its optimizer (attach(model, optimizer=opt))")
            collector = TorchCollector(target, optimizer, parsed)
        collector.on_alarm = on_alarm
        collector.attach()
        with contextlib.suppress(TypeError):  # a target that takes no weak reference is not remembered
            _ATTACHED[target] = collector
        return collector
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if collector is not None:  # hooks installed before the failure come off again
            collector.closed = True
            with contextlib.suppress(Exception):
                collector.unhook()
        # One line in the job's log (the README's promise); the traceback only for those who ask (DEBUG).
        log.error("steplens collector: not attached (%s); the job goes on without it", reason)
        log.debug("steplens collector: why attach failed", exc_info=True)
        return InactiveCollector(reason)
