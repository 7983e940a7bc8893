import gzip
import json
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "corpus"


@pytest.fixture
def corpus() -> Path:
    if not CORPUS.is_dir():
        pytest.skip(f"shared corpus not found at {CORPUS}")
    return CORPUS


def write_trace(path: Path, events: list, gz: bool = False, **top) -> Path:
    """A small Kineto-style trace file from a list of event dicts (and top-level keys)."""
    doc = {"schemaVersion": 1, **top, "traceEvents": events}
    data = json.dumps(doc, indent=1).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path
