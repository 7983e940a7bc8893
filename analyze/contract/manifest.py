"""run.json, the manifest of a run directory: its keys, their types and meaning, in one declaration.

Written by the ingest (analyze/pipeline/ingest.py) through `RunManifest.to_json`; read by anything that
opens a run directory. Readers are tolerant: a run.json written by an older steplens (keys missing) or a
newer one (keys unknown here) still loads, missing keys taking their defaults. The writer is strict: a key
that is not a field here is a programming error, so every key run.json can hold is declared below.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field


@dataclass
class RunManifest:
    schema_version: int = 0  # schema.SCHEMA_VERSION of the writer (0: not recorded)
    schema_fingerprint: str | None = None  # schema.fingerprint(): parts written under another layout are re-parsed
    parse_fingerprint: str | None = None  # reuse.parse_fingerprint(): parts another parser wrote are re-parsed
    run_id: str | None = None  # hash of the run folder and the used sources' fingerprints
    created_by: str | None = None  # "steplens ingest": marks an output folder steplens may replace
    world_size: int | None = None  # settle_world_size: from the traces, else the run facts
    ranks: list[int] = field(default_factory=list)  # ranks with traces or telemetry rows
    trace_ranks: list[int] = field(default_factory=list)  # ranks with profiler traces
    sources: list[dict] = field(default_factory=list)  # one per input file: path, size, status, kind, rank, issues, ...
    ignored_files: list[str] = field(default_factory=list)  # files in no format steplens reads (the first ones)
    ignored_count: int = 0  # how many such files in all
    facts: dict = field(default_factory=dict)  # merged run facts (versions, ds_config, ...; disagreements under conflicts)
    environment: dict = field(default_factory=dict)  # device names and SMs, backend, NCCL/CUDA versions from traces
    tables: dict[str, dict] = field(default_factory=dict)  # {table: {"partitioned_by_rank": bool}}
    run_name: str | None = None  # the run folder's name
    output_entries: list[str] | None = None  # every entry of the output folder, once it is complete
    # Object storage only (null in a folder): every object of the result, relative to the output URL,
    # with its size in bytes. This run.json, written last, is the commit: readers ignore other objects.
    objects: dict[str, int] | None = None
    # Hash of what the result depends on (every input's fingerprint, the names of unread files, the
    # analysis options, the steplens code): a re-run with the same key reuses the result as it is.
    input_key: str | None = None
    # Made with the default options, on a local folder: contract/reuse.listing_key over every file under
    # it and the steplens code, and what a re-run with nothing changed prints (cli_rerun.py), so the
    # `analyze` script can answer that re-run before importing the rest of steplens.
    rerun: dict | None = None
    # Which input settled world_size (settle_world_size): "traces", or "run facts: PATH"; null when none states it.
    world_size_source: str | None = None

    def to_dict(self) -> dict:
        """The JSON object, keys in declaration order; output_entries only once known."""
        doc = dataclasses.asdict(self)
        if self.output_entries is None:
            del doc["output_entries"]
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    @classmethod
    def from_dict(cls, doc: dict, strict: bool = False) -> RunManifest:
        """Known keys of `doc`; an unknown key raises when `strict` (the writer), else is ignored (readers)."""
        known = {f.name for f in dataclasses.fields(cls)}
        if strict and (unknown := set(doc) - known):
            raise KeyError(f"run.json keys not declared in RunManifest: {sorted(unknown)}")
        return cls(**{key: value for key, value in doc.items() if key in known})

    @classmethod
    def from_json(cls, text: str) -> RunManifest:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("run.json does not hold a JSON object")
        return cls.from_dict(doc)


# The run facts the analyses and reports read by type. They come from files a job left (a log's printed
# ds_config, a collector manifest, a launcher's command line), so a damaged one can hold anything: a fact
# of another type is left out of the run's facts, with an issue on the file that gave it, rather than
# failing an analysis. Counts are whole numbers up to 2**53 (JSON's exact integers); steps up to 2**31 - 1.
OBJECT_FACTS = ("ds_config", "settings", "collector_flags", "environment", "git", "wandb", "megatron_args",
                "autotune_summary", "autotune_model_info", "model_shape", "collector_profiler")
POSITIVE_COUNT_FACTS = ("world_size", "dp_world_size", "train_batch_size", "gradient_accumulation_steps", "micro_batch",
                        "grad_accum", "seq_len", "sequence_length", "train_micro_batch_size_per_gpu",
                        "data_parallel_size", "model_parallel_size", "batch_size_per_gpu")
COUNT_FACTS = ("zero_stage", "profile_step", "param_count", "first_flush_step")
MAX_COUNT = 2**53
MAX_STEP = 2**31 - 1


def is_count(value, lowest: int = 0) -> bool:
    """A whole number from `lowest` to MAX_COUNT (JSON's exact integers), not true/false."""
    return type(value) is int and lowest <= value <= MAX_COUNT


def fact_problem(key: str, value) -> str | None:
    """What is wrong with a run fact's value for the way it is read, or None when it is fine (or unknown here)."""
    if value is None:
        return None
    if key in OBJECT_FACTS and not isinstance(value, dict):
        return f"not a JSON object but {type(value).__name__}"
    lowest = 1 if key in POSITIVE_COUNT_FACTS else 0 if key in COUNT_FACTS else None
    if lowest is not None and not is_count(value, lowest):
        return f"not a whole number from {lowest} to 2**53: {str(value)[:40]!r}"
    if key in ("checkpoint_steps", "evaluation_steps") and not (isinstance(value, list)
                                          and all(type(s) is int and 0 <= s <= MAX_STEP for s in value)):
        return "not a list of step numbers"
    return None


# The run's world size, stated once for ingest, the analyses and the readers of a published run, from its inputs in
# this order of precedence:
# 1. the traces: the world size each profiler trace records (Kineto's distributedInfo.world_size, an Nsight Systems
#    process's WORLD_SIZE), torch.distributed's own count; the largest when they disagree (ingest then reports
#    world_size_mismatch on every trace);
# 2. the run facts: the world_size the first other input states (a collector manifest, a launcher's or Megatron's log,
#    a comms dump, a flops profile); one that disagrees with the traces is reported (world_size_mismatch), not used.
# Else no input states it: null. run.json records the size (world_size) and which input gave it (world_size_source).
WORLD_SIZE_FROM_TRACES = "traces"


def settle_world_size(trace_world_sizes: list[int], fact_world_size: int | None,
                      fact_source: str | None) -> tuple[int | None, str | None]:
    """(the run's world size, the input it comes from) by the precedence above."""
    if trace_world_sizes:
        return max(trace_world_sizes), WORLD_SIZE_FROM_TRACES
    if fact_world_size is not None:
        return fact_world_size, f"run facts: {fact_source}"
    return None, None


def run_facts(manifest: dict) -> dict:
    """A published run's facts as the analyses read them: world_size is the run's settled one (run.json), which
    a fact of another input does not override."""
    facts = dict(manifest.get("facts") or {})
    if manifest.get("world_size") is not None:
        facts["world_size"] = manifest["world_size"]
    return facts


def data_parallel_size(facts: dict, world_size: int | None) -> int | None:
    """Data-parallel ranks: DeepSpeed's dp_world_size where the run states it, else the world size (no model or
    pipeline parallelism recorded: every rank holds a replica)."""
    return facts.get("dp_world_size") or world_size


def process_count(manifest: dict) -> int:
    """How many processes the run had, for the analyses that must count them (GPUs for MFU, a collective's group
    size when its trace does not record it): the settled world size, else the traced ranks (the fewest the job had)."""
    return manifest.get("world_size") or len(manifest.get("trace_ranks") or [])


def lost_inputs(manifest: dict) -> list[str]:
    """The inputs of a published run that lost data (an error issue, or not read at all): `analyze` exited 1 on
    it, and whatever reads the run (compare) says so. Entries of the wrong shape (an edited run.json) are skipped."""
    lost = []
    for source in manifest.get("sources") or []:
        if not isinstance(source, dict):
            continue
        issues = source.get("issues") if isinstance(source.get("issues"), list) else []
        if source.get("status") == "error" or any(isinstance(i, list) and i[:1] == ["error"] for i in issues):
            lost.append(str(source.get("path")))
    return lost


def _max_rank() -> int:
    # here, not at the top: the collector imports this module (through alarm_rules) and has no use for schema, which
    # builds every table's Arrow schema when imported
    from steplens.analyze.contract.schema import MAX_RANK

    return MAX_RANK


def missing_ranks(manifest: dict) -> str | None:
    """'traces of N of W ranks; no trace for rank(s) ...' for a run traced on fewer ranks than its world size (profiled
    on some ranks only, or lost: the issues say which), else None."""
    world_size = manifest.get("world_size")
    traced = manifest.get("trace_ranks") or []
    if traced and type(world_size) is int and 0 < world_size <= _max_rank() and len(traced) < world_size:
        # The gaps between traced ranks, never a set over range(world_size) (a trace may claim 2**24 ranks).
        bounds = [-1, *sorted({rank for rank in traced if type(rank) is int and 0 <= rank < world_size}), world_size]
        gaps = [(low + 1, high - 1) for low, high in zip(bounds, bounds[1:]) if high - low > 1]
        missing = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in gaps)
        return (f"traces of {len(traced)} of {world_size} ranks; no trace for rank(s) {missing} (profiled on some ranks "
                "only, or lost: see the issues)")
    return None


# The run.json fields readers of a published run (the sql `runs` view, compare, trials) rely on, and the type each
# must have (null aside).
_RUN_FIELDS = {"run_name": str, "world_size": int, "ranks": list, "environment": dict, "created_by": str, "facts": dict}


def damage(manifest) -> str | None:
    """What makes a published run.json unusable (not an object, or a field of the wrong type), or None."""
    if not isinstance(manifest, dict):
        return f"run.json holds {type(manifest).__name__}, not an object"
    wrong = [key for key, kind in _RUN_FIELDS.items() if manifest.get(key) is not None and (
        not isinstance(manifest[key], kind) or (kind is int and isinstance(manifest[key], bool)))]
    if "world_size" not in wrong and manifest.get("world_size") is not None and fact_problem("world_size", manifest["world_size"]):
        wrong.append("world_size")  # a count of processes: from 1
    if "ranks" not in wrong and isinstance(manifest.get("ranks"), list) and not all(
            type(r) is int and 0 <= r < _max_rank() for r in manifest["ranks"]):
        wrong.append("ranks")  # rank numbers: integers from 0
    devices = (manifest.get("environment") or {}).get("device_names") if "environment" not in wrong else None
    if devices is not None and not (isinstance(devices, list) and all(isinstance(d, str) for d in devices)):
        wrong.append("environment.device_names")
    # ingest kept only facts of the type they are read as (fact_problem): one that is not was edited afterwards
    if "facts" not in wrong and isinstance(manifest.get("facts"), dict):
        wrong += [f"facts.{key}" for key, value in manifest["facts"].items() if fact_problem(key, value)]
    return f"{', '.join(wrong)} of the wrong type or out of range" if wrong else None
