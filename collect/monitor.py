"""A DeepSpeed Monitor backend, beside TensorBoard / W&B / CSV: every `write_events` scalar goes into the
collector's `scalars` table, with step = global samples as DeepSpeed gives it.

DeepSpeed 0.19.8's MonitorMaster holds one slot per built-in backend and no list to register another in,
so `EngineCollector` chains this backend's `write_events` after the master's. Imported only when attaching
to an engine (it imports deepspeed).
"""

from __future__ import annotations

from deepspeed.monitor.monitor import Monitor


class SteplensMonitor(Monitor):
    def __init__(self, collector):
        super().__init__(monitor_config=None)
        self.collector = collector
        self.enabled = True

    def write_events(self, event_list) -> None:
        """event_list: (name, value, global_samples) tuples, as the engine writes them."""
        self.collector.guard("scalars", self.collector.record_events, event_list)
