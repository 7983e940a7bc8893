"""gs:// for real: a run in a GCS emulator (gcp-storage-emulator, serving Google's JSON API on loopback,
which gcsfs reaches through STORAGE_EMULATOR_HOST) analysed from gs:// gives the tables of the same run
analysed from disk, committed under gs:// as under s3://; no credentials, and an endpoint that does not
answer, are one line each naming what to set."""

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from synthetic import generate_run
from test_cluster import assert_same_tables, output_tables
from test_object_storage import fetch_committed, steplens

emulator = pytest.importorskip("gcp_storage_emulator.server")
gcsfs = pytest.importorskip("gcsfs")

BUCKET = "runs"
# The emulator serves the JSON API only: gcsfs's lookup of a bucket's layout (a gRPC call to Google) would
# fail and warn on every bucket, so it is turned off.
JSON_API_ONLY = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


@pytest.fixture(scope="module")
def store():
    """A GCS emulator on a free loopback port holding an empty bucket; the environment a client of it needs."""
    server = emulator.create_server("127.0.0.1", 0, in_memory=True, default_bucket=BUCKET)
    server.start()
    host, port = server._api._httpd.server_address  # port 0: the emulator has no other way to tell the port
    env = {**JSON_API_ONLY, "STORAGE_EMULATOR_HOST": f"http://{host}:{port}"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        yield gcsfs.GCSFileSystem(skip_instance_cache=True), env
    server.stop()


def test_run_in_gcs_gives_the_local_tables(store, tmp_path):
    fs, env = store
    run = tmp_path / "run3"
    generate_run(run, ranks=3, steps=2, kernels_per_step=20, seed=21)
    fs.put(str(run), f"{BUCKET}/g/run3", recursive=True)
    reference = tmp_path / "local"
    assert steplens("analyze", run, "--out", reference).returncode == 0

    done = steplens("analyze", f"gs://{BUCKET}/g/run3", "--out", f"gs://{BUCKET}/g/out", env=env)
    assert done.returncode == 0, done.stderr
    fs.invalidate_cache()
    manifest, folder = fetch_committed(fs, f"{BUCKET}/g/out", tmp_path / "fetched")
    assert manifest["run_name"] == "run3" and manifest["trace_ranks"] == [0, 1, 2]
    assert_same_tables(output_tables(reference), output_tables(folder))

    # Read back through the commit, as from s3://.
    query = "SELECT rank, count(*) AS events FROM trace_events GROUP BY rank ORDER BY rank"
    remote = steplens("sql", f"gs://{BUCKET}/g/out", query, "--format", "csv", env=env)
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == steplens("sql", reference, query, "--format", "csv").stdout


def one_message(stderr: str) -> bool:
    """One error: its first line, and the lines it wraps onto (80 columns) indented under it."""
    lines = stderr.splitlines()
    return bool(lines) and lines[0].startswith("error: ") and all(line.startswith("  ") for line in lines[1:])


def test_unreachable_endpoint_names_what_to_set(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **JSON_API_ONLY, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"}
    done = subprocess.run([sys.executable, "-m", "steplens.analyze", f"gs://{BUCKET}/g/run3", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2
    assert one_message(done.stderr) and "Traceback" not in done.stderr, done.stderr
    assert f"cannot reach http://127.0.0.1:{port}" in done.stderr and "STORAGE_EMULATOR_HOST" in done.stderr
    assert not (tmp_path / "o").exists()


class AnonymousRefused(BaseHTTPRequestHandler):
    """Answers every request as GCS answers a caller without credentials (gcsfs falls back to anonymous)."""

    def do_GET(self):
        body = json.dumps({"error": {"code": 401, "message": "Anonymous caller does not have storage.objects.list "
                                     "access to the Google Cloud Storage bucket.", "errors": []}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_missing_credentials_name_the_variable_to_set(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), AnonymousRefused)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**{k: v for k, v in os.environ.items() if k != "GOOGLE_APPLICATION_CREDENTIALS"}, **JSON_API_ONLY,
               "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{server.server_address[1]}"}
        done = subprocess.run([sys.executable, "-m", "steplens.analyze", f"gs://{BUCKET}/g/run3", "--out",
                               str(tmp_path / "o")], capture_output=True, text=True, timeout=300, env=env)
    finally:
        server.shutdown()
    assert done.returncode == 2
    assert one_message(done.stderr) and "Traceback" not in done.stderr, done.stderr
    assert "no credentials for gs://: set GOOGLE_APPLICATION_CREDENTIALS" in " ".join(done.stderr.split())
    assert not (tmp_path / "o").exists()
