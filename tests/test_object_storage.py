"""Runs and results in object storage, against a real S3-compatible server (moto in server mode) on
loopback: a run analysed straight from s3:// gives the tables of the same run analysed from disk; an
unchanged run is not parsed again; the result is committed by its run.json, written last, and readers
(`steplens sql`, `export-trace`) see only the objects it names; a truncated object costs the rest of that
file, reported; missing credentials name the variable to set."""

import json
import os
import subprocess
import sys
import urllib.request
import zlib
from pathlib import Path

import polars as pl
import pytest

from steplens.analyze.contract import schema
from synthetic import generate_run
from test_cluster import assert_same_tables, output_tables

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")

BUCKET = "runs"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
# No credentials from anywhere else: the user's files, or an instance-metadata lookup that would wait.
ISOLATED = {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A moto S3 server on a free loopback port; the environment a client of it needs."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps one store per process: a module started after another would find its buckets
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    env = {**ISOLATED, **CREDENTIALS, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield fs, env
    server.stop()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """A 4-rank generated run and its analysis from disk (the reference)."""
    run = tmp_path_factory.mktemp("s3") / "run4"
    generate_run(run, ranks=4, steps=3, kernels_per_step=20, seed=5)
    reference = run.parent / "local"
    done = steplens("analyze", run, "--out", reference)
    assert done.returncode == 0, done.stderr
    return run, reference


def steplens(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    extra = ["-q"] if args[0] == "analyze" else []
    return subprocess.run([sys.executable, "-c", "from steplens.analyze.cli import steplens_entry; steplens_entry()",
                           *map(str, args), *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def fetch_committed(fs, url: str, into: Path) -> tuple[dict, Path]:
    """The committed run.json under url, and the objects it names copied into a local folder."""
    manifest = json.loads(fs.cat_file(f"{url}/{schema.MANIFEST_FILE}"))
    for key in manifest["objects"]:
        target = into / key
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{url}/{key}", str(target))
    generations = {key.split("/")[0] for key in manifest["objects"]}
    assert len(generations) == 1
    return manifest, into / generations.pop()


def test_run_in_s3_gives_the_local_tables_and_an_unchanged_run_is_not_parsed_again(store, generated, tmp_path):
    fs, env = store
    run, reference = generated
    fs.put(str(run), f"{BUCKET}/a/run4", recursive=True)
    done = steplens("analyze", f"s3://{BUCKET}/a/run4", "--out", f"s3://{BUCKET}/a/out", env=env)
    assert done.returncode == 0, done.stderr
    fs.invalidate_cache()
    first, folder = fetch_committed(fs, f"{BUCKET}/a/out", tmp_path / "first")
    assert_same_tables(output_tables(reference), output_tables(folder))
    local = json.loads((reference / schema.MANIFEST_FILE).read_text())
    assert first["run_name"] == "run4" and first["trace_ranks"] == local["trace_ranks"] == [0, 1, 2, 3]
    # Every object of the result is named, with its size; nothing else is under the output prefix.
    assert sorted(first["objects"]) == sorted(str(p.relative_to(tmp_path / "first")) for p in folder.rglob("*")
                                              if p.is_file())
    assert all(fs.size(f"{BUCKET}/a/out/{key}") == size for key, size in first["objects"].items())

    again = steplens("analyze", f"s3://{BUCKET}/a/run4", "--out", f"s3://{BUCKET}/a/out", env=env)
    assert again.returncode == 0, again.stderr
    fs.invalidate_cache()
    second, folder = fetch_committed(fs, f"{BUCKET}/a/out", tmp_path / "second")
    traces = {s["path"]: s["status"] for s in second["sources"] if s["path"].startswith("rank-")}
    assert traces == {f"rank-{r}.pt.trace.json.gz": "reused" for r in range(4)}
    assert_same_tables(output_tables(reference), output_tables(folder))
    # The first result's objects went once the second was committed.
    assert not any(fs.exists(f"{BUCKET}/a/out/{key}") for key in first["objects"] if key not in second["objects"])


def test_a_local_run_can_publish_to_s3(store, generated, tmp_path):
    fs, env = store
    run, reference = generated
    done = steplens("analyze", run, "--out", f"s3://{BUCKET}/local-run/out", env=env)
    assert done.returncode == 0, done.stderr
    fs.invalidate_cache()
    manifest, folder = fetch_committed(fs, f"{BUCKET}/local-run/out", tmp_path / "fetched")
    assert manifest["trace_ranks"] == [0, 1, 2, 3]
    assert_same_tables(output_tables(reference), output_tables(folder))
    assert not (run / schema.DEFAULT_OUT_DIR).exists()  # nothing written beside the inputs


def test_readers_see_only_committed_objects(store, generated, tmp_path):
    fs, env = store
    run, reference = generated
    fs.put(str(run), f"{BUCKET}/b/run4", recursive=True)
    assert steplens("analyze", f"s3://{BUCKET}/b/run4", env=env).returncode == 0  # default out: RUN/.steplens
    out = f"s3://{BUCKET}/b/run4/{schema.DEFAULT_OUT_DIR}"
    # An upload cut short before its commit: a generation no run.json names.
    fs.invalidate_cache()
    committed = json.loads(fs.cat_file(f"{out}/{schema.MANIFEST_FILE}"))
    part = next(key for key in committed["objects"] if key.split("/")[1] == "trace_events")
    fs.copy(f"{out}/{part}", f"{out}/g-20000101T000000-00000000/trace_events/rank=0/part-0000000000000000.parquet")

    query = "SELECT rank, count(*) AS events FROM trace_events GROUP BY rank ORDER BY rank"
    remote = steplens("sql", out, query, "--format", "csv", env=env)
    local = steplens("sql", reference, query, "--format", "csv")
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and remote.stdout.count("\n") == 5

    merged_remote, merged_local = tmp_path / "remote.json", tmp_path / "local.json"
    done = steplens("export-trace", out, "--out", merged_remote, env=env)
    assert done.returncode == 0, done.stderr
    assert steplens("export-trace", reference, "--out", merged_local).returncode == 0
    remote_doc, local_doc = json.loads(merged_remote.read_bytes()), json.loads(merged_local.read_bytes())
    events = [sorted(json.dumps(e, sort_keys=True) for e in doc.pop("traceEvents")) for doc in (remote_doc, local_doc)]
    assert events[0] == events[1] and len(events[0]) > 1000  # the same events (thread names come in any order)
    assert remote_doc == local_doc


def test_truncated_object_costs_the_rest_of_that_file(store, generated, tmp_path):
    fs, env = store
    run, reference = generated
    fs.put(str(run), f"{BUCKET}/c/run4", recursive=True)
    whole = (run / "rank-2.pt.trace.json.gz").read_bytes()
    fs.pipe_file(f"{BUCKET}/c/run4/rank-2.pt.trace.json.gz", whole[:len(whole) // 2])  # an upload cut in half
    done = steplens("analyze", f"s3://{BUCKET}/c/run4", "--out", tmp_path / "out", env=env)
    assert done.returncode == 1, done.stderr  # partial: data lost
    got = output_tables(tmp_path / "out")
    issues = got["ingest_issues"].filter(pl.col("file") == "rank-2.pt.trace.json.gz")
    assert "truncated" in issues["reason"].to_list()
    # The complete events before the cut are kept: as many as the cut file's decompressible prefix holds.
    prefix = zlib.decompressobj(31).decompress(whole[:len(whole) // 2])
    complete = prefix.count(b'"ph": "X"') + prefix.count(b'"ph":"X"')
    events = got["trace_events"].filter(pl.col("rank") == 2)
    assert 0 < events.filter(pl.col("ph") == "X").height <= complete
    expected = output_tables(reference)["trace_events"]
    for rank in (0, 1, 3):
        assert got["trace_events"].filter(pl.col("rank") == rank).equals(expected.filter(pl.col("rank") == rank))


def test_missing_credentials_name_the_variables_to_set(store, generated, tmp_path):
    fs, env = store
    run, _ = generated
    fs.put(str(run), f"{BUCKET}/d/run4", recursive=True)
    without = {k: v for k, v in os.environ.items() if k not in CREDENTIALS}
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", f"s3://{BUCKET}/d/run4", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, env={**without, "AWS_DEFAULT_REGION": "us-east-1"})
    assert done.returncode == 2
    assert "no credentials for s3://" in done.stderr and "AWS_ACCESS_KEY_ID" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "o").exists()


def test_several_runs_under_one_url_are_split_as_a_local_folder_is(store, tmp_path):
    """Two jobs side by side under one prefix (each with ranks 0 and 1): two runs, each analysed into its own
    output with the tables of the same folder analysed from disk, never merged."""
    fs, env = store
    runs = tmp_path / "jobs"
    for seed, job in enumerate(("job-a", "job-b")):
        generate_run(runs / job, ranks=2, steps=2, kernels_per_step=20, seed=10 + seed)
    fs.put(str(runs), f"{BUCKET}/multi/jobs", recursive=True)
    local = steplens("analyze", runs)
    assert local.returncode == 0, local.stderr

    done = steplens("analyze", f"s3://{BUCKET}/multi/jobs", "--out", f"s3://{BUCKET}/multi/out", env=env)
    assert done.returncode == 0, done.stderr
    assert "holds 2 runs" in done.stdout and "job-a:" in done.stdout and "job-b:" in done.stdout
    fs.invalidate_cache()
    for job in ("job-a", "job-b"):
        manifest, folder = fetch_committed(fs, f"{BUCKET}/multi/out/{job}", tmp_path / "fetched" / job)
        reference = runs / job / schema.DEFAULT_OUT_DIR
        assert manifest["run_name"] == job and manifest["trace_ranks"] == [0, 1]
        local_manifest = json.loads((reference / schema.MANIFEST_FILE).read_text())
        assert sorted(s["path"] for s in manifest["sources"]) == sorted(s["path"] for s in local_manifest["sources"])
        assert_same_tables(output_tables(reference), output_tables(folder))

    # Without --out each run's result is committed beside its inputs, as a local run's is.
    done = steplens("analyze", f"s3://{BUCKET}/multi/jobs", env=env)
    assert done.returncode == 0, done.stderr
    fs.invalidate_cache()
    for job in ("job-a", "job-b"):
        _, folder = fetch_committed(fs, f"{BUCKET}/multi/jobs/{job}/{schema.DEFAULT_OUT_DIR}", tmp_path / "beside" / job)
        assert_same_tables(output_tables(runs / job / schema.DEFAULT_OUT_DIR), output_tables(folder))


def test_a_prefix_that_does_not_exist_is_named_as_given(store, tmp_path):
    """It said '/tmp/steplens-mirror-.../exp: not a folder', a local temporary folder the user never gave."""
    _, env = store
    url = f"s3://{BUCKET}/no/such/exp"
    done = steplens("analyze", url, "--out", tmp_path / "o", env=env)
    assert done.returncode == 2, done.stderr
    assert " ".join(done.stderr.split()) == f"error: {url}: no objects under this prefix (is the bucket or path mistyped?)"
    assert not (tmp_path / "o").exists()
