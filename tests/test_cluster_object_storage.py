"""`analyze --scheduler` with an object-store --out, against a real scheduler with two worker processes and
a real S3-compatible server (moto) on loopback: the workers write their parts straight into the result's
uncommitted generation, which no reader sees until run.json, written last, names it; the committed
tables are the single-process run's; what no commit names is deleted once it is safe."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steplens.analyze.contract import schema
import test_object_storage
from test_cluster import assert_same_tables, output_tables
from test_object_storage import BUCKET, fetch_committed, steplens

distributed = pytest.importorskip("distributed")
pytest.importorskip("moto.server")
# The moto server and the generated 4-rank run with its local analysis, as in test_object_storage.
store, generated = test_object_storage.store, test_object_storage.generated


class PauseAtRankAnalyses(distributed.WorkerPlugin):
    """Holds each worker at its first per-rank analysis (every trace is parsed and uploaded by then) until
    the file `release` exists; `marker` tells the test it got there."""

    def __init__(self, marker: str, release: str):
        self.marker, self.release = marker, release

    def transition(self, key, start, finish, **kwargs):
        if finish != "executing" or "steplens-rank-" not in str(key):
            return
        Path(self.marker).touch()
        deadline = time.monotonic() + 120
        while not os.path.exists(self.release) and time.monotonic() < deadline:
            time.sleep(0.1)


def test_workers_write_parts_to_the_store_and_readers_see_them_only_once_committed(store, generated, tmp_path):
    fs, env = store
    run, reference = generated
    prefix, out = f"{BUCKET}/e/run4", f"{BUCKET}/e/out"
    # The previous result: ranks 0-2 (rank 3's trace is uploaded after it).
    for path in sorted(run.iterdir()):
        if path.name != "rank-3.pt.trace.json.gz":
            fs.put_file(str(path), f"{prefix}/{path.name}")
    assert steplens("analyze", f"s3://{prefix}", "--out", f"s3://{out}", env=env).returncode == 0
    fs.put_file(str(run / "rank-3.pt.trace.json.gz"), f"{prefix}/rank-3.pt.trace.json.gz")
    fs.invalidate_cache()
    previous = json.loads(fs.cat_file(f"{out}/{schema.MANIFEST_FILE}"))
    # What runs that died left: one two days old (deleted by the next commit), one young (perhaps a run still
    # going: kept). Neither is named by a commit, so no reader sees either.
    part = next(key for key in previous["objects"] if key.split("/")[1] == "trace_events")
    dead = f"{out}/g-20000101T000000-00000000/trace_events/rank=0/part-0000000000000000.parquet"
    young = f"{out}/g-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-0000beef/trace_events/rank=0/part-0.parquet"
    for leftover in (dead, young):
        fs.copy(f"{out}/{part}", leftover)

    query = "SELECT rank, count(*) AS events FROM trace_events GROUP BY rank ORDER BY rank"
    before = steplens("sql", f"s3://{out}", query, "--format", "csv", env=env)
    assert before.returncode == 0 and before.stdout.count("\n") == 4, before.stderr  # header and ranks 0-2

    marker, release = tmp_path / "paused", tmp_path / "release"
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as cluster, distributed.Client(cluster.scheduler_address) as client:
        client.register_plugin(PauseAtRankAnalyses(str(marker), str(release)))
        analysis = subprocess.Popen(
            [sys.executable, "-m", "steplens.analyze", f"s3://{prefix}", "--out", f"s3://{out}", "--scheduler",
             cluster.scheduler_address, "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **env})
        try:
            deadline = time.monotonic() + 240
            while not marker.exists() and analysis.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert marker.exists(), analysis.stderr.read() if analysis.poll() is not None else "not paused in time"
            # Rank 3 parsed and its parts uploaded by a worker, into a generation no commit names yet ...
            fs.invalidate_cache()
            assert json.loads(fs.cat_file(f"{out}/{schema.MANIFEST_FILE}")) == previous
            uncommitted = [p for p in fs.find(out) if "/trace_events/rank=3/" in p]
            assert len(uncommitted) == 1
            assert uncommitted[0].split("/")[len(out.split("/"))] not in {k.split("/")[0] for k in previous["objects"]}
            # ... so a reader sees the previous result only.
            assert steplens("sql", f"s3://{out}", query, "--format", "csv", env=env).stdout == before.stdout
        finally:
            release.touch()
            stdout, stderr = analysis.communicate(timeout=300)
        assert analysis.returncode == 0, stderr
        logs = [message for records in client.get_worker_logs().values() for _, message in records]

    fs.invalidate_cache()
    committed, folder = fetch_committed(fs, out, tmp_path / "committed")
    assert_same_tables(output_tables(reference), output_tables(folder))
    sources = {s["path"]: s["status"] for s in committed["sources"] if s["path"].startswith("rank-")}
    assert sources == {**{f"rank-{r}.pt.trace.json.gz": "reused" for r in range(3)}, "rank-3.pt.trace.json.gz": "ingested"}
    # The workers wrote to the store: rank 3's parts from its parse task, every rank's from its analyses.
    generation = f"s3://{out}/{next(iter(committed['objects'])).split('/')[0]}"
    assert any("steplens: parsing rank-3.pt.trace.json.gz" in m and f"parts to {generation}" in m for m in logs)
    assert sorted(int(rank) for m in logs if f"parts to {generation}" in m and "analysing ranks" in m
                  for rank in m.split("analysing ranks ")[1].split()[0].split("-")) == [0, 1, 2, 3]
    # Nothing left but the commit: the previous result, the dead run's generation; the young one stays.
    fs.invalidate_cache()
    left = {p[len(out) + 1:].split("/")[0] for p in fs.find(out)}
    assert left == {schema.MANIFEST_FILE, generation.rsplit("/", 1)[1], young[len(out) + 1:].split("/")[0]}
