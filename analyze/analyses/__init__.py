"""The analyses, one module per question, each declaring its `registry.Analysis` as ANALYSIS: what it reads, its
typed tables, its finding (under its name), its sentences and its report section. Every analysis is listed here
once, in any order (the runner orders them by their inputs); adding one is a module and a line below.
"""

import pyarrow as pa

from steplens.analyze.analyses import (alarm_agreement, autotune, caveats, comms, comms_log, device_timeline,
                                       input_problems, job_end, kernels, launch, memory, mfu, module_perf, monitor,
                                       profiler_effect, roofline, sanity, step_breakdown, step_time, steps, summaries)
from steplens.analyze.analyses.registry import Analysis

ANALYSES: list[Analysis] = [
    device_timeline.ANALYSIS,
    steps.ANALYSIS,
    comms.ANALYSIS,  # collectives
    launch.ANALYSIS,  # gpu_idle
    kernels.ANALYSIS,  # top_kernels
    step_breakdown.ANALYSIS,
    step_time.ANALYSIS,
    mfu.ANALYSIS,
    module_perf.ANALYSIS,
    roofline.ANALYSIS,
    summaries.ANALYSIS,
    monitor.ANALYSIS,
    alarm_agreement.ANALYSIS,
    autotune.ANALYSIS,
    comms_log.ANALYSIS,
    job_end.ANALYSIS,
    sanity.ANALYSIS,
    input_problems.ANALYSIS,
    caveats.ANALYSIS,
    memory.ANALYSIS,
    profiler_effect.ANALYSIS,
]
# Every analysis table of the run directory, as its analysis declares it: name -> (typed schema, column docs).
TABLES: dict[str, tuple[pa.Schema, dict[str, str]]] = {table: spec for analysis in ANALYSES
                                                        for table, spec in analysis.writes.items()}
