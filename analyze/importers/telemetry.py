"""The importers of what a job left besides traces, registered one line each: each reads one file into
rows of the run-level tables in `schema` plus run facts (the interface is `base.Importer`)."""

from __future__ import annotations

from pathlib import Path

from steplens.analyze.importers import autotune_results, collector_parts, comms_dump, flops_text, monitor_scalars
from steplens.analyze.importers.base import Importer

LOG_SUFFIXES = (".log", ".txt", ".out")  # deepspeed_log.SUFFIXES (test_dslog checks they agree)


def claims_log(path: Path) -> bool:
    """deepspeed_log.claims, importing that module only for a file with a log's suffix: compiling its fifty
    regexes is 10-15 ms of every `analyze` process's start, and most runs hold no log."""
    if not path.name.endswith(LOG_SUFFIXES):
        return False
    from steplens.analyze.importers import deepspeed_log

    return deepspeed_log.claims(path)


def parse_log(path: Path, rel: str, run_index: int | None = None):
    from steplens.analyze.importers import deepspeed_log

    return deepspeed_log.parse(path, rel, run_index=run_index)


# Order is priority: specific file names before generic suffixes.
IMPORTERS: list[Importer] = [
    Importer("collector", collector_parts.claims, collector_parts.parse),
    Importer("autotune_experiment", autotune_results.claims_experiment, autotune_results.parse_experiment, autotune_results.experiment_companions),
    Importer("autotune_summary", autotune_results.claims_summary, autotune_results.parse_summary, autotune_results.summary_companions),
    Importer("tensorboard", monitor_scalars.claims_tensorboard, monitor_scalars.parse_tensorboard),
    Importer("wandb", monitor_scalars.claims_wandb, monitor_scalars.parse_wandb),
    Importer("csv_monitor", monitor_scalars.claims_csv, monitor_scalars.parse_csv_monitor),
    Importer("deepspeed_comms_dict", comms_dump.claims_raw, comms_dump.parse_raw, comms_dump.summary_sibling),
    Importer("deepspeed_comms_summary_dict", comms_dump.claims_summary, comms_dump.parse_summary),
    Importer("deepspeed_flops_profile", flops_text.claims, flops_text.parse, flops_text.ds_config_files),
    Importer("deepspeed_log", claims_log, parse_log),  # after the FLOPs text: a log may embed a profile
]


def claimant(path: Path) -> Importer | None:
    for importer in IMPORTERS:
        if importer.claims(path):
            return importer
    return None
