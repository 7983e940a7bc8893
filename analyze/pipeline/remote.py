"""Runs and outputs in object storage: RUN_DIR and --out as s3://, gs:// or any other fsspec URL.

Reading a run: its objects are listed once. Every object is first offered to the importers through a
local stub holding its first 64 KiB (all `claims` looks at), in a mirror of the run's layout. The
objects an importer claims (logs, monitor files, comms dumps, collector parts: small) and their
companions are downloaded whole into the mirror, with the object's modification time, and read as
local files. Trace candidates (.json/.gz that no importer claims) are never downloaded: the parser
streams them in chunks (json_events.ByteStream over an fsspec file), and their fingerprint is the
object's size, modification time and ETag, so an unchanged trace is not read again.

Writing a result: it is built in a local folder as for a local --out (the last committed result's
ingested parts fetched into it first, so unchanged inputs are reused), then uploaded under a new
generation prefix OUT/g-<time>-<random>/. OUT/run.json, written last in one PUT, names every object
of the result (`objects`): it is the commit, since an object store has no atomic rename. Readers read
only the objects it names, so an interrupted upload is never seen; the previous result's objects are
deleted only after the commit.

fsspec and the store's package (s3fs, gcsfs: the `remote` extra) are imported only for URLs.
Credentials and endpoints come from each store's standard variables and files.
"""

from __future__ import annotations

import atexit
import calendar
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterator

from steplens.analyze.contract import schema
from steplens.analyze.contract.manifest import RunManifest
from steplens.analyze.pipeline.ingest import HASH_PREFIX_BYTES, OUTPUT_CREATOR, Discovered, IngestError, Source, classify

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Block size of a streamed object: a few of the parser's 2 MiB chunks per request, bounded memory.
READ_BLOCK_BYTES = 8 << 20
GENERATION = re.compile(r"g-(\d{8}T\d{6})-[0-9a-f]{8}")
# An uncommitted generation older than this is a run that died (no analysis takes a day): the next commit
# deletes it. A younger one may be a run still going, and is left alone (readers ignore it either way).
ABANDONED_AFTER_S = 24 * 3600
# What to set when a store refuses for want of credentials, by protocol.
CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE; AWS_ENDPOINT_URL for a store other than AWS)",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS (a service-account key file)",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS (a service-account key file)",
    "az": "AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY)",
    "abfs": "AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY)",
}
# Exceptions that mean "no credentials", by class name: their packages are optional.
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError", "ClientAuthenticationError"}
# Where each store is reached, and the variable that points the client elsewhere (an emulator, MinIO).
ENDPOINTS = {
    "s3": ("AWS_ENDPOINT_URL", "https://s3.amazonaws.com"),
    "gs": ("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com"),
    "gcs": ("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com"),
}
# Exceptions that mean "no connection to the store", by class name (aiohttp's, botocore's).
_UNREACHABLE = {"ClientConnectorError", "ClientConnectorDNSError", "EndpointConnectionError", "ConnectTimeoutError",
                "ServerTimeoutError"}
# gcsfs logs every failed request, with its traceback, before it raises; the error is reported in one line
# here. (A handler of its own keeps logging's last-resort stderr output away; an application's logging
# configuration still gets the records.)
logging.getLogger("gcsfs").addHandler(logging.NullHandler())


class StorageError(IngestError):
    """A URL steplens cannot use (no package for it, no credentials, unreachable, refused); one line."""


def is_url(location) -> bool:
    """An fsspec URL other than a local file (`file://` paths are read as paths)."""
    match = URL.match(str(location))
    return bool(match) and match.group(1).lower() not in ("file", "local")


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def filesystem(url: str):
    """(fsspec filesystem, path within it) for a URL; a missing package or protocol is a StorageError."""
    try:
        import fsspec.core
    except ImportError:
        raise StorageError(f"{url}: reading URLs needs fsspec: pip install 'steplens[remote]'") from None
    protocol = URL.match(url).group(1)
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise StorageError(f"{url}: {protocol}:// needs a package that is not installed ({e}): "
                           "pip install 'steplens[remote]'") from None
    except ValueError as e:
        raise StorageError(f"{url}: {e}") from None
    return fs, path.rstrip("/")


def storage_error(url: str, error: BaseException) -> StorageError:
    """One line naming what the user must do: the variable to set, or what the store answered."""
    protocol = URL.match(url).group(1) if URL.match(url) else "?"
    # An anonymous caller (gcsfs without credentials) is answered 401
    if type(error).__name__ in _NO_CREDENTIALS or getattr(error, "code", None) == 401:
        wanted = CREDENTIALS.get(protocol, f"the credentials {protocol}:// expects")
        return StorageError(f"{url}: no credentials for {protocol}://: set {wanted}")
    if type(error).__name__ in _UNREACHABLE or isinstance(error, ConnectionError):
        variable, default = ENDPOINTS.get(protocol, (None, None))
        endpoint = (os.environ.get(variable) or default) if variable else f"the {protocol}:// store"
        fix = f"check the network, or set {variable} to the store's address" if variable else "check the network"
        return StorageError(f"{url}: cannot reach {endpoint} ({type(error).__name__}): {fix}")
    if isinstance(error, PermissionError):
        return StorageError(f"{url}: access denied by the store ({error}): check the credentials' permissions")
    if isinstance(error, FileNotFoundError):
        return StorageError(f"{url}: no such bucket or object")
    return StorageError(f"{url}: the store cannot be reached or refused: {type(error).__name__}: {error}")


# ---------------------------------------------------------------------------------------------
# Reading a run


@dataclass(frozen=True)
class RemoteFile:
    """One object of a run in object storage."""

    url: str
    size: int
    mtime_ns: int
    etag: str

    def source(self, relative: str) -> Source:
        """Its run.json entry, named by its path below the run's URL (as a local run's files are, so a
        run found among several under one URL is named alike), fingerprinted by size, modification time
        and ETag (nothing is read)."""
        source = Source(path=relative, size=self.size, mtime_ns=self.mtime_ns,
                        hash_prefix=hashlib.sha256(f"etag:{self.etag}".encode()).hexdigest()[:16])
        source.part_id = hashlib.sha256(repr(source.fingerprint()).encode()).hexdigest()[:16]
        return source


class StreamedObject:
    """An object the trace parser streams: `name` as a path's, `open()` as an fsspec OpenFile's."""

    def __init__(self, url: str):
        self.url = url
        self.name = url.rsplit("/", 1)[-1]

    def open(self):
        fs, path = filesystem(self.url)
        return fs.open(path, "rb", block_size=READ_BLOCK_BYTES, cache_type="readahead")


def _mtime_ns(info: dict) -> int:
    for key in ("LastModified", "mtime", "updated", "last_modified", "created"):
        value = info.get(key)
        if isinstance(value, datetime):
            return int(value.timestamp() * 1e9)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value * 1e9)
        if isinstance(value, str):
            try:
                return int(datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1e9)
            except ValueError:
                continue
    return 0


def _etag(fs, path: str, info: dict) -> str:
    """The store's version tag of the object; a store without one: a hash of its first 64 KiB."""
    for key in ("ETag", "etag", "md5Hash", "generation", "checksum"):
        if info.get(key):
            return str(info[key]).strip('"')
    return "head:" + hashlib.sha256(fs.cat_file(path, start=0, end=HASH_PREFIX_BYTES)).hexdigest()


def _hidden(relative: str) -> bool:
    return any(part.startswith(".") for part in relative.split("/"))


def discover(url: str) -> tuple[Path, Discovered]:
    """The run under url: (its local mirror, what is in it). Traces are listed, not downloaded; the
    mirror is removed when the process ends."""
    fs, root = filesystem(url)
    try:
        listing = fs.find(root, detail=True)
    except Exception as e:  # noqa: BLE001 - any store error becomes one line naming the fix
        raise storage_error(url, e) from e
    name = root.rstrip("/").rsplit("/", 1)[-1] or "run"
    mirror = Path(tempfile.mkdtemp(prefix="steplens-mirror-")) / name
    atexit.register(shutil.rmtree, mirror.parent, True)
    remote: dict[Path, RemoteFile] = {}
    for key, info in sorted(listing.items()):
        relative = key[len(root) + 1:] if key.startswith(root + "/") else ""
        if info.get("type", "file") != "file" or not relative or _hidden(relative):
            continue
        file = RemoteFile(url=f"{URL.match(url).group(1)}://{key}", size=int(info.get("size") or 0),
                          mtime_ns=_mtime_ns(info), etag=_etag(fs, key, info))
        local = mirror / relative
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            local.write_bytes(fs.cat_file(key, start=0, end=HASH_PREFIX_BYTES) if file.size else b"")
        except Exception as e:  # noqa: BLE001
            raise storage_error(file.url, e) from e
        os.utime(local, ns=(file.mtime_ns, file.mtime_ns))
        remote[local] = file
    if not remote:  # else the message would name the (empty) local mirror
        raise IngestError(f"{url}: no objects under this prefix (is the bucket or path mistyped?)")
    found = classify(list(remote))
    for path, _, companions in found.native:  # read whole by their importers: small, downloaded
        for local in [path, *companions]:
            if local in remote and local.stat().st_size < remote[local].size:
                _download(fs, remote[local], local)
    found.traces = [p for p in found.traces if p in remote]
    found.remote = {p: remote[p] for p in found.traces}
    found.origin = url.rstrip("/")
    return mirror, found


def _download(fs, file: RemoteFile, local: Path) -> None:
    try:
        fs.get_file(file.url.split("://", 1)[1], str(local))
    except Exception as e:  # noqa: BLE001
        raise storage_error(file.url, e) from e
    os.utime(local, ns=(file.mtime_ns, file.mtime_ns))


# ---------------------------------------------------------------------------------------------
# Writing a result


class RemoteLocation(str):
    """A published result's URL; `/` and `read_text` as on a local output folder's Path."""

    def __truediv__(self, part: str) -> RemoteLocation:
        return RemoteLocation(join(self, str(part)))

    def read_text(self) -> str:
        fs, path = filesystem(self)
        return fs.cat_file(path).decode()


def committed(url: str) -> dict:
    """The committed run.json under url ({} when there is none, or it is not steplens's)."""
    fs, root = filesystem(url)
    try:
        text = fs.cat_file(join(root, schema.MANIFEST_FILE))
    except FileNotFoundError:
        return {}
    except Exception as e:  # noqa: BLE001
        raise storage_error(url, e) from e
    try:
        manifest = json.loads(text)
    except ValueError:
        return {}
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("objects"), dict) else {}


def check_output(url: str) -> None:
    """Refuse an output prefix holding objects steplens did not commit (it deletes old results there)."""
    fs, root = filesystem(url)
    try:
        manifest = committed(url)
        if manifest.get("created_by") == OUTPUT_CREATOR:
            return
        entries = fs.ls(root, detail=False) if fs.exists(root) else []
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001
        raise storage_error(url, e) from e
    if entries:
        raise StorageError(f"{url} holds objects and no steplens {schema.MANIFEST_FILE}: give a new prefix with --out")


@contextmanager
def output_folder(url: str) -> Iterator[Path]:
    """A local folder to build the result in, holding the last committed result's ingested parts (so
    unchanged inputs are reused); removed when the block ends. `commit` publishes it."""
    check_output(url)
    fs, root = filesystem(url)
    work = Path(tempfile.mkdtemp(prefix="steplens-out-"))
    local = work / (root.rsplit("/", 1)[-1] or "out")
    try:
        previous = committed(url)
        if previous.get("created_by") == OUTPUT_CREATOR:
            wanted = [key for key in previous["objects"] if key.split("/")[1:2] and key.split("/")[1] in schema.TABLES]
            targets = [str(local / key.split("/", 1)[1]) for key in wanted]
            for target in targets:
                Path(target).parent.mkdir(parents=True, exist_ok=True)
            try:
                fs.get([join(root, key) for key in wanted], targets)
            except Exception as e:  # noqa: BLE001
                raise storage_error(url, e) from e
            local.mkdir(parents=True, exist_ok=True)
            kept = {k: v for k, v in previous.items() if k != "objects"}
            kept["output_entries"] = sorted(os.listdir(local)) + [schema.MANIFEST_FILE]
            (local / schema.MANIFEST_FILE).write_text(RunManifest.from_dict(kept).to_json())
        yield local
    finally:
        shutil.rmtree(work, ignore_errors=True)


def put_files(prefix: str, files: dict[str, Path]) -> dict[str, int]:
    """Upload local files to prefix/<relative path> (on a worker too); {relative path: size}."""
    if not files:
        return {}
    fs, root = filesystem(prefix)
    try:
        fs.put([str(path) for path in files.values()], [join(root, relative) for relative in files])
    except Exception as e:  # noqa: BLE001
        raise storage_error(prefix, e) from e
    return {relative: path.stat().st_size for relative, path in files.items()}


def get_files(prefix: str, files: dict[str, Path]) -> None:
    """Download prefix/<relative path> to each local path (on a worker too)."""
    if not files:
        return
    fs, root = filesystem(prefix)
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fs.get([join(root, relative) for relative in files], [str(path) for path in files.values()])
    except Exception as e:  # noqa: BLE001
        raise storage_error(prefix, e) from e


class Generation:
    """A result being written under OUT/g-<time>-<random>/, by this process and (analyze --scheduler) by
    the workers straight from their tasks. Nothing names its objects until `commit` writes OUT/run.json,
    so readers see none of them before."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.name = f"g-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"
        self.uploaded: dict[str, int] = {}  # path below `prefix` -> size, of the objects already there

    @property
    def prefix(self) -> str:
        return join(self.url, self.name)

    def put_missing(self, local: Path, relatives: list[str]) -> None:
        """Upload the local result's files that are not there yet (under the same relative paths)."""
        missing = {r: local / r for r in relatives if self.uploaded.get(r) != (local / r).stat().st_size}
        self.uploaded.update(put_files(self.prefix, missing))

    def abandon(self) -> None:
        """Delete what this run uploaded, unless a commit names it (the run failed, or was stopped)."""
        try:
            if any(key.startswith(f"{self.name}/") for key in committed(self.url).get("objects", {})):
                return
            fs, root = filesystem(self.url)
            fs.rm(join(root, self.name), recursive=True)
        except Exception:  # noqa: BLE001 - left-over objects are ignored by readers; a later commit deletes them
            pass


def commit(local: Path, url: str, generation: Generation | None = None) -> RemoteLocation:
    """Upload the published local result under its generation (what the workers uploaded already is not
    sent again), then write url/run.json naming every object (the commit), then delete what no commit
    names: the previous result's objects, this run's parts it did not use, and generations of runs that
    died. Returns the result's URL."""
    fs, root = filesystem(url)
    previous = committed(url)
    generation = generation or Generation(url)
    files = {p.relative_to(local).as_posix(): p for p in sorted(local.rglob("*"))
             if p.is_file() and p.name != schema.MANIFEST_FILE}
    objects = {f"{generation.name}/{relative}": path.stat().st_size for relative, path in files.items()}
    manifest = json.loads((local / schema.MANIFEST_FILE).read_text())
    manifest["objects"] = objects
    generation.put_missing(local, list(files))
    try:
        fs.pipe_file(join(root, schema.MANIFEST_FILE), RunManifest.from_dict(manifest, strict=True).to_json().encode())
    except Exception as e:  # noqa: BLE001 - the previous commit stands: its run.json was not replaced
        raise storage_error(url, e) from e
    unused = [f"{generation.name}/{relative}" for relative in generation.uploaded if relative not in files]
    stale = [key for key in previous.get("objects", {}) if key not in objects and GENERATION.match(key)]
    try:
        if stale + unused:
            fs.rm([join(root, key) for key in stale + unused])
        for abandoned in _abandoned_generations(fs, root, generation.name):
            fs.rm(abandoned, recursive=True)
    except Exception:  # noqa: BLE001 - left-over objects are ignored by readers; the commit stands
        pass
    return RemoteLocation(join(url, generation.name))


def _abandoned_generations(fs, root: str, current: str) -> list[str]:
    """The generation prefixes under root that no commit names and are older than ABANDONED_AFTER_S."""
    fs.invalidate_cache(root)
    abandoned = []
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        match = GENERATION.fullmatch(name)
        if match and name != current:
            started = calendar.timegm(time.strptime(match.group(1), "%Y%m%dT%H%M%S"))
            if time.time() - started > ABANDONED_AFTER_S:
                abandoned.append(path)
    return abandoned


# ---------------------------------------------------------------------------------------------
# Reading a result


def committed_runs(url: str) -> list[tuple[str, dict]]:
    """(result URL, run.json) of every committed result under url (url included)."""
    fs, root = filesystem(url)
    try:
        manifests = [root + "/" + schema.MANIFEST_FILE] if fs.isfile(join(root, schema.MANIFEST_FILE)) else []
        manifests += [p for p in fs.glob(join(root, "**", schema.MANIFEST_FILE)) if p not in manifests]
    except Exception as e:  # noqa: BLE001
        raise storage_error(url, e) from e
    protocol = URL.match(url).group(1)
    runs = []
    for manifest_path in sorted(set(manifests)):
        run_url = f"{protocol}://{manifest_path.rsplit('/', 1)[0]}"
        manifest = committed(run_url)
        if manifest and "schema_version" in manifest:
            runs.append((run_url, manifest))
    return runs


def table_objects(run_url: str, manifest: dict, table: str) -> list[str]:
    """The URLs of a table's objects named by the commit (never an object it does not name)."""
    return sorted(join(run_url, key) for key in manifest.get("objects", {})
                  if key.split("/")[1:2] == [table] and key.endswith(".parquet"))
