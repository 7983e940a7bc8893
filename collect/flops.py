"""Per-module FLOPs of one forward pass, as exact numbers, with DeepSpeed's FlopsProfiler.

The profiler is started here, before the forward, through its direct API: started by the engine (from inside
the root module's pre-hook) it misses the root's start time and reports a bogus root latency
(deepspeed-artifacts.md pitfall 5). The table is read after `stop_profile()` and before `end_profile()`,
which deletes the per-module attributes.
"""

from __future__ import annotations


class FlopsCapture:
    def __init__(self, model):
        from deepspeed.profiling.flops_profiler.profiler import FlopsProfiler

        self.model = model
        self.profiler = FlopsProfiler(model)
        self.profiler.start_profile()

    def finish(self) -> list[dict]:
        """Per-module rows (always ends the profile, so no hook stays on the model)."""
        from deepspeed.profiling.flops_profiler.profiler import (
            get_module_duration,
            get_module_flops,
            get_module_macs,
        )

        try:
            self.profiler.stop_profile()
            rows = []
            for path, module in self.model.named_modules():
                rows.append({
                    "path": path, "module_class": type(module).__name__,
                    "depth": path.count(".") + 1 if path else 0,
                    # ZeRO-3 leaves a partitioned parameter with numel() 0; ds_numel is its full size.
                    "params": sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters()),
                    "macs": int(module.__macs__), "flops": int(module.__flops__),
                    "macs_total": int(get_module_macs(module)), "flops_total": int(get_module_flops(module)),
                    "duration_ns": round(get_module_duration(module) * 1e9),
                    "duration_bogus": False, "exact": True,
                })
            return rows
        finally:
            self.profiler.end_profile()
