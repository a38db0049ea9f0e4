"""Full-size tensors (Fisher, masks, deltas) and folders (trained models): the artifact store.

Two backends behind one interface (`Store`), chosen in one place, `open_store(settings)`:
the local folder below (the embedded default: ARTIFACT_ROOT, FISHERLENS_HOME/artifacts) and
S3-compatible object storage (ARTIFACT_URL=s3://BUCKET/PREFIX, storage/s3store.py) for workers on
machines that share no disk. Every reader calls `store.fetch(rel_path, sha256)` for a verified
local path; writers call save_tensors / save_bytes / save_folder and record the ArtifactInfo's
sha256 in the database only after they return (the publish point).

The folder backend:

Layout: <root>/<job_id>/<kind>.safetensors and <root>/<job_id>/<kind>/ (folders). Files are written
atomically (temp file in the same folder, fsync, os.replace) and their sha256 is recorded; reads
verify it, so a truncated or tampered file is an error that says so, never silently wrong numbers.
Paths handed back are relative to the root, so the database survives moving the root.
torch is imported only inside the tensor functions (the web process hashes and streams files).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Protocol

from storage.artifact_common import (  # noqa: F401 - re-exported: the store's public names
    ARTIFACT_KIND_PATTERN,
    ArtifactError,
    ArtifactInfo,
    ArtifactMissing,
    ArtifactStoreUnavailable,
    check_kind,
    on_uploaded,
    retry_policy,
    sha256_dir,
    sha256_file,
    tensors_bytes,
    upload_retries,
    uploaded_hook,
)


class ArtifactStore:
    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser().resolve()

    # -- paths ------------------------------------------------------------------------------
    def job_dir(self, job_id: int) -> Path:
        return self.root / str(int(job_id))

    def resolve(self, rel_path: str) -> Path:
        """Absolute path of a stored artifact path; refuses paths escaping the root."""
        p = Path(rel_path)
        full = (p if p.is_absolute() else self.root / p).resolve()
        if not full.is_relative_to(self.root):
            raise ArtifactError(
                f"artifact path {rel_path!r} is outside the artifact root {self.root}"
            )
        return full

    def _rel(self, full: Path) -> str:
        return full.relative_to(self.root).as_posix()

    @staticmethod
    def _check_kind(kind: str) -> None:
        check_kind(kind)

    # -- tensors ----------------------------------------------------------------------------
    def save_tensors(
        self,
        job_id: int,
        kind: str,
        tensors: dict[str, Any],
        metadata: dict[str, str] | None = None,
    ) -> ArtifactInfo:
        """Write {name: tensor} as <root>/<job_id>/<kind>.safetensors atomically."""
        self._check_kind(kind)
        data = tensors_bytes(tensors, metadata)
        return self.save_bytes(job_id, f"{kind}.safetensors", data, kind=kind)

    def save_bytes(
        self, job_id: int, filename: str, data: bytes, kind: str | None = None
    ) -> ArtifactInfo:
        folder = self.job_dir(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / filename
        fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        digest = hashlib.sha256(data).hexdigest()
        return ArtifactInfo(kind or filename, self._rel(final), digest, len(data))

    def verify(self, rel_path: str, sha256: str) -> Path:
        """The absolute path, after checking the file (or folder) exists and matches sha256."""
        full = self.resolve(rel_path)
        if not full.exists():
            raise ArtifactError(f"artifact {rel_path!r} is missing under {self.root}")
        actual = sha256_dir(full)[0] if full.is_dir() else sha256_file(full)
        if actual != sha256:
            raise ArtifactError(
                f"artifact {rel_path!r} is corrupt: sha256 {actual[:12]}... does not match the "
                f"recorded {sha256[:12]}...; re-run the job to regenerate it"
            )
        return full

    def load_tensors(self, rel_path: str, sha256: str | None) -> dict[str, Any]:
        """Read a safetensors artifact after verifying its sha256 (None skips the check)."""
        from safetensors.torch import load

        full = self.verify(rel_path, sha256) if sha256 is not None else self.resolve(rel_path)
        return load(full.read_bytes())

    # -- folders ----------------------------------------------------------------------------
    def save_folder(self, job_id: int, kind: str, src: Path | str) -> ArtifactInfo:
        """Move (or copy, across file systems) folder `src` to <root>/<job_id>/<kind>/ ; a plain
        file is stored as <root>/<job_id>/<kind><suffix>."""
        self._check_kind(kind)
        src = Path(src)
        if not src.exists():
            raise ArtifactError(f"files[{kind!r}]: {src} does not exist")
        folder = self.job_dir(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        if src.is_file():
            final = folder / f"{kind}{src.suffix}"
            tmp = folder / f".{final.name}.tmp"
            shutil.copyfile(src, tmp)
            os.replace(tmp, final)
            return ArtifactInfo(kind, self._rel(final), sha256_file(final), final.stat().st_size)
        final = folder / kind
        staging = folder / f".{kind}.incoming"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.move(str(src), str(staging))
        if final.exists():  # a re-delivered job replaces its previous folder
            shutil.rmtree(final)
        os.replace(staging, final)
        digest, size = sha256_dir(final)
        return ArtifactInfo(kind, self._rel(final), digest, size, is_dir=True)

    def remove_job(self, job_id: int) -> None:
        shutil.rmtree(self.job_dir(job_id), ignore_errors=True)

    # -- reading for compute ----------------------------------------------------------------
    def fetch(self, rel_path: str, sha256: str) -> Path:
        """A verified local path of a stored artifact (file or folder), for code that reads it
        with ordinary file APIs (safetensors, from_pretrained). The folder backend verifies the
        file in place, re-hashing only when a file changed since its last verification; other
        backends (object storage) return a verified copy in their local cache.
        ArtifactError when it is missing or does not match `sha256`."""
        full = self.resolve(rel_path)
        if not full.exists():
            raise ArtifactMissing(f"artifact {rel_path!r} is missing from the artifact store")
        key = (str(full), sha256)
        fp = _fingerprint(full)
        if _VERIFIED.get(key) != fp:
            self.verify(rel_path, sha256)
            _VERIFIED[key] = fp
        return full


    # -- the rest of the Store interface ----------------------------------------------------
    remote = False

    def describe(self) -> str:
        return str(self.root)

    def exists(self, rel_path: str) -> bool:
        return self.resolve(rel_path).exists()

    def read_bytes(self, rel_path: str) -> bytes | None:
        """A small file's bytes (unverified: figure JSON), None when there is none."""
        try:
            return self.resolve(rel_path).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def download_url(self, rel_path: str, sha256: str, filename: str, expires_s: int) -> str | None:
        return None  # the web streams the verified file

    def release(self, path: Path | None = None) -> None:
        """Nothing to release: files are read in place."""

    def scratch_root(self) -> Path:
        """Where workers' per-job scratch folders go: on the store's file system, so trained
        model folders are moved into it, not copied."""
        return self.root / ".scratch"

    def local_roots(self) -> list[Path]:
        """Local folders whose files are artifacts of this store (a path there is an artifact)."""
        return [self.root]

    def check(self) -> str:
        """Write, read back and delete a probe file (fisherlens doctor)."""
        self.root.mkdir(parents=True, exist_ok=True)
        probe = self.root / f".doctor-{os.getpid()}"
        probe.write_bytes(b"fisherlens doctor")
        try:
            if probe.read_bytes() != b"fisherlens doctor":
                raise ArtifactError(f"artifact folder {self.root}: a probe file read back different bytes")
        finally:
            probe.unlink()
        return f"{self.root}: write, read back and delete ok"


class Store(Protocol):
    """What every artifact-store backend provides (ArtifactStore, s3store.S3ArtifactStore)."""

    remote: bool

    def describe(self) -> str: ...
    def save_tensors(self, job_id: int, kind: str, tensors: dict[str, Any],
                     metadata: dict[str, str] | None = None) -> ArtifactInfo: ...
    def save_bytes(self, job_id: int, filename: str, data: bytes,
                   kind: str | None = None) -> ArtifactInfo: ...
    def save_folder(self, job_id: int, kind: str, src: Path | str) -> ArtifactInfo: ...
    def fetch(self, rel_path: str, sha256: str) -> Path: ...
    def load_tensors(self, rel_path: str, sha256: str | None) -> dict[str, Any]: ...
    def exists(self, rel_path: str) -> bool: ...
    def read_bytes(self, rel_path: str) -> bytes | None: ...
    def download_url(self, rel_path: str, sha256: str, filename: str,
                     expires_s: int) -> str | None: ...
    def remove_job(self, job_id: int) -> None: ...
    def release(self, path: Path | None = None) -> None: ...
    def scratch_root(self) -> Path: ...
    def local_roots(self) -> list[Path]: ...
    def check(self) -> str: ...


_VERIFIED: dict[tuple[str, str], tuple[Any, ...]] = {}  # (path, sha256) -> file fingerprint


def _fingerprint(path: Path) -> tuple[Any, ...]:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


_remote: dict[tuple[Any, ...], Store] = {}
_remote_guard = threading.Lock()


def open_store(settings: Any) -> Store:
    """The artifact store the settings name: the one constructor every reader and writer uses
    (web, worker, CLI), so that the backend is chosen in one place. ARTIFACT_URL=s3://... selects
    object storage (one client and cache per process and configuration), else the folder."""
    url = getattr(settings, "artifact_url", None)
    if not url:
        return ArtifactStore(settings.artifacts_dir)
    from storage.artifact_cache import ArtifactCache
    from storage.s3store import S3ArtifactStore, make_client

    secret = settings.aws_secret_access_key
    key = (url, str(settings.artifact_cache), int(settings.artifact_cache_max_bytes),
           settings.aws_endpoint_url, settings.aws_access_key_id,
           secret.get_secret_value() if secret is not None else None, settings.aws_default_region)
    with _remote_guard:
        store = _remote.get(key)
        if store is None:
            cache = ArtifactCache(settings.artifact_cache, settings.artifact_cache_max_bytes)
            store = _remote[key] = S3ArtifactStore(url, cache, make_client(settings))
        return store


def protected_roots(settings: Any) -> list[Path]:
    """The folders whose files are artifacts (other users' bytes): the store's local folder(s),
    ARTIFACT_ROOT, and this machine's artifact cache (an object store's downloaded copies),
    resolved. A reference whose file really is in one (by a link, or a hard link) is refused at
    submit (app.services.refs) and by the worker (compute.worker.refs)."""
    roots = [Path(r).resolve() for r in open_store(settings).local_roots()]
    roots += [Path(settings.artifacts_dir).resolve(), Path(settings.artifact_cache).resolve()]
    return list(dict.fromkeys(roots))
