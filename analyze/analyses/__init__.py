"""The analyses, one module per question. Those declared as `registry.Analysis` are listed here, in
any order (the runner orders them by their inputs); adding one is a module and a line below."""

from steplens.analyze.analyses import memory, profiler_effect
from steplens.analyze.analyses.registry import Analysis

REGISTERED: list[Analysis] = [memory.ANALYSIS, profiler_effect.ANALYSIS]
