"""In-job alarms on rank 0: the rules of `steplens.analyze.contract.alarm_rules` (the same code `analyze` replays
and its post-hoc monitor_alarms analysis runs over every scalar series),
fed at each flush on the writer's thread (never inside a training step), a watchdog thread for
`no_progress`, and the sinks every alarm goes to:

  a log line                       `steplens alarm: ...` on the `steplens.collect` logger
  the `alarms` table               collector/alarms/rank0-<seq>.parquet, read by `analyze`
  the user's callback              `attach(engine, on_alarm=fn)`: fn(alarm dict); returning "stop_training"
                                   sets `collector.stop_requested` (the job decides whether to stop)
  a Prometheus pushgateway         setting `pushgateway` ("host:port"), via prometheus_client

The callback and the pushgateway run on their own threads behind bounded queues: one that raises, or takes
longer than `alarm_timeout_s`, is logged once and disabled, and alarms for a full queue are counted, never
waited for. Straggling ranks are judged from the other ranks' flushed parts in the run folder: no collective.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from steplens.analyze.contract import alarm_rules, layout

log = logging.getLogger("steplens.collect")
QUEUE_SIZE = 64  # alarms waiting for one sink; more are counted as dropped


class Sink:
    """One delivery function on its own daemon thread behind a bounded queue."""

    def __init__(self, name: str, deliver, timeout_s: float):
        self.name = name
        self.deliver = deliver
        self.timeout_s = timeout_s
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
        self.failure: str | None = None
        self.dropped = 0
        self.busy_since: float | None = None
        self.thread = threading.Thread(target=self.run, name=f"steplens-alarm-{name}", daemon=True)
        self.thread.start()

    def disable(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.warning("steplens alarm sink %s disabled: %s", self.name, reason)

    def hung(self) -> bool:
        busy = self.busy_since
        if busy is not None and time.monotonic() - busy > self.timeout_s:
            self.disable(f"a delivery took over {self.timeout_s:g} s")
        return self.failure is not None

    def offer(self, alarm: dict) -> None:
        if self.hung():
            self.dropped += 1
            return
        try:
            self.queue.put_nowait(alarm)
        except queue.Full:
            self.dropped += 1

    def run(self) -> None:
        while True:
            alarm = self.queue.get()
            if alarm is None or self.failure is not None:
                self.queue.task_done()
                if alarm is None:
                    return
                continue
            self.busy_since = time.monotonic()
            try:
                self.deliver(alarm)
            except Exception as exc:
                self.disable(f"{type(exc).__name__}: {exc}")
            self.busy_since = None
            self.queue.task_done()

    def drain(self, deadline: float) -> None:
        """Until the queue is delivered or `deadline` (monotonic) passes; a sink still busy then is disabled."""
        while self.queue.unfinished_tasks and not self.hung() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.queue.unfinished_tasks and self.failure is None:
            self.disable(f"alarms still undelivered after {self.timeout_s:g} s at close")
        try:
            self.queue.put_nowait(None)
        except queue.Full:
            pass


def pushgateway_sink(address: str, job: str, instance: str, timeout_s: float):
    """Deliver an alarm as gauges pushed to a Prometheus pushgateway, grouped by job and instance."""
    from prometheus_client import CollectorRegistry, Gauge, push_to_gateway

    registry = CollectorRegistry()
    labels = ["rule", "name", "severity", "rank"]
    value = Gauge("steplens_alarm_value", "Value that raised the alarm", labels, registry=registry)
    step = Gauge("steplens_alarm_step", "Optimizer step of the latest alarm", labels, registry=registry)
    count = Gauge("steplens_alarms", "Alarms raised so far", labels, registry=registry)

    def push(alarm: dict) -> None:
        key = [alarm["rule"], alarm["name"], alarm["severity"], str(alarm["rank"])]
        value.labels(*key).set(float("nan") if alarm["value"] is None else alarm["value"])
        step.labels(*key).set(alarm["step"])
        count.labels(*key).inc()
        push_to_gateway(address, job=job, registry=registry, grouping_key={"instance": instance}, timeout=timeout_s)

    return push


class Alarms:
    """Rank 0's alarm evaluation and delivery for one collector."""

    def __init__(self, collector, rules: list[alarm_rules.Rule], on_alarm=None):
        self.collector = collector
        settings = collector.settings
        # The steps this collector instruments (its profiler schedule, its FLOPs step): the step rules skip them
        # (a profiler window's step time is the profiler's); checkpoint saves are added as they happen.
        instrumented = {step for step, _reason in alarm_rules.profiled_steps(settings.profile)}
        if collector.flops_step is not None:
            instrumented.add(collector.flops_step)
        self.engine = alarm_rules.AlarmEngine(rules, collector.rank, instrumented)
        self.timeout_s = settings.alarm_timeout_s
        self.sinks: list[Sink] = []
        if on_alarm is not None:
            self.sinks.append(Sink("callback", self.callback(on_alarm), self.timeout_s))
        if settings.pushgateway:
            job, instance = self.labels()
            self.sinks.append(Sink("pushgateway", pushgateway_sink(settings.pushgateway, job, instance, self.timeout_s),
                                   self.timeout_s))
        self.unwritten: list[dict] = []  # alarm rows for the next alarms part
        self.lock = threading.Lock()
        self.raised = 0
        self.other_rows: dict[str, dict[int, list[dict]]] = {"train_steps": {}, "comms_calls": {}}
        self.parts_read: set[Path] = set()
        self.judged_step = -1
        self.part_seq = collector.writer.seq
        self.stop = threading.Event()
        self.stalled_step: int | None = None
        self.watchdog = None
        if any(rule.kind == "no_progress" for rule in rules):
            self.watchdog = threading.Thread(target=self.watch, name="steplens-alarm-watchdog", daemon=True)
            self.watchdog.start()

    def labels(self) -> tuple[str, str]:
        """Prometheus job and instance: the run folder's name, and host and rank from the manifest."""
        host = (self.collector.host or {}).get("hostname") or "unknown-host"
        return self.collector.run_dir.name or "steplens", f"{host}-rank{self.collector.rank}"

    def callback(self, on_alarm):
        def call(alarm: dict) -> None:
            if on_alarm(dict(alarm)) == "stop_training":
                self.collector.stop_requested = True
        return call

    # --- evaluation (writer thread) --------------------------------------------------------------------

    def evaluate(self, scalars: list[dict], steps: list[dict], comms: list[dict]) -> None:
        """Rows of one flush, in the order recorded; then the steps every rank has flushed."""
        engine, alarms = self.engine, []
        for row in scalars:
            alarms += engine.scalar(row["name"], row["step"], row["global_samples"], row["value"], row["wall_ns"])
        for step in alarm_rules.step_times(steps):
            alarms += engine.step(step["step"], step["step_ns"], step["global_samples"], step["wall_ns"])
        if self.collector.world_size > 1 and any(rule.kind == "straggler" for rule in engine.rules):
            alarms += self.stragglers(steps, comms)
        self.deliver(alarms)
        self.write_table()

    def stragglers(self, steps: list[dict], comms: list[dict]) -> list[dict]:
        own = self.collector.rank
        self.other_rows["train_steps"].setdefault(own, []).extend(steps)
        self.other_rows["comms_calls"].setdefault(own, []).extend(comms)
        self.read_other_ranks()
        alarms = []
        # A rank not seen yet holds the judging (as in the replay, which has every rank's rows), but one that
        # stopped writing (killed, writer disabled), more than two flushes behind this rank, is left out.
        rows_by_rank = {rank: self.other_rows["train_steps"].get(rank, []) for rank in range(self.collector.world_size)}
        latest = {rank: max((r["step"] for r in rows if r["step"] is not None), default=-1)
                  for rank, rows in rows_by_rank.items()}
        behind = latest[own] - 2 * self.collector.settings.flush_every
        steps_by_rank = {rank: rows for rank, rows in rows_by_rank.items() if latest[rank] >= behind}
        judged = alarm_rules.busy_steps(steps_by_rank, self.other_rows["comms_calls"], self.judged_step)
        for step, busy, wall_ns in judged:
            alarms += self.engine.ranks(step, busy, wall_ns)
            self.judged_step = step
        if len(steps_by_rank) < 2:  # no one left to compare with: nothing to keep
            self.judged_step = max(self.judged_step, latest[own])
        for table in self.other_rows.values():  # keep what is still to judge, and the last judged step (its end)
            for rank, rows in table.items():
                table[rank] = [row for row in rows if row["step"] is not None and row["step"] >= self.judged_step]
        return alarms

    def read_other_ranks(self) -> None:
        """New parts of the other ranks; one that cannot be read is skipped (its rank's steps stay unjudged)."""
        import pyarrow.parquet as pq

        columns = {"train_steps": ["step", "start_ns", "end_ns", "is_boundary", "global_samples"],
                   "comms_calls": ["step", "latency_ns"]}
        root = self.collector.writer.root
        for table, wanted in columns.items():
            for path in sorted((root / table).glob(layout.PART_GLOB)):
                rank, _ = layout.parse_part_name(path.name)
                if rank == self.collector.rank or path in self.parts_read:
                    continue
                self.parts_read.add(path)
                try:
                    rows = pq.read_table(path, columns=wanted).to_pylist()
                except Exception as exc:
                    log.debug("steplens alarms: skipped %s (%s)", path, exc)
                    continue
                self.other_rows[table].setdefault(rank, []).extend(
                    r for r in rows if r["step"] is not None and r["step"] >= self.judged_step)

    # --- no_progress (watchdog thread) -------------------------------------------------------------------

    def watch(self) -> None:
        threshold = min(r.threshold for r in self.engine.rules if r.kind == "no_progress")
        poll_s = min(5.0, threshold / 4)
        while not self.stop.wait(poll_s):
            last_end, done = self.collector.last_step_end, self.collector.completed_steps
            if last_end is None or self.stalled_step == done:
                continue
            silent_s = time.monotonic() - last_end
            if silent_s > threshold:
                self.stalled_step = done  # one alarm per stall
                self.deliver(self.engine.no_progress(done - 1, self.collector.samples_at_last_step, silent_s,
                                                     time.time_ns()))

    # --- delivery ------------------------------------------------------------------------------------------

    def deliver(self, alarms: list[dict]) -> None:
        for alarm in alarms:
            self.raised += 1
            log.warning("steplens alarm: [%s] %s %s at step %s: %s", alarm["severity"], alarm["rule"], alarm["name"],
                        alarm["step"], alarm["detail"])
            if alarm["stop_training"]:
                self.collector.stop_requested = True
            with self.lock:
                self.unwritten.append(alarm)
            for sink in self.sinks:
                sink.offer(alarm)

    def write_table(self) -> None:
        with self.lock:
            rows, self.unwritten = self.unwritten, []
        writer = self.collector.writer
        if not rows:
            return
        if writer.failure is not None:  # counted with the other rows it could not write
            writer.fail(writer.failure, {"alarms": rows})
            return
        try:
            writer.write_part("alarms", [{**{k: row[k] for k in alarm_rules.ALARM_FIELDS}, "source": "collector"}
                                         for row in rows], self.part_seq)
            self.part_seq += 1
        except Exception as exc:  # the other sinks go on
            writer.fail(f"{type(exc).__name__}: {exc}", {"alarms": rows})

    def close(self) -> None:
        """After the last evaluation: stop the watchdog, write what it raised, deliver what is queued (bounded)."""
        self.stop.set()
        self.write_table()
        deadline = time.monotonic() + self.timeout_s
        for sink in self.sinks:
            sink.drain(deadline)

    def summary(self) -> dict:
        return {"raised": self.raised, "sinks": {s.name: {"disabled": s.failure, "dropped": s.dropped} for s in self.sinks}}
