"""Full-size tensors (Fisher, masks, deltas) and folders (trained models) under an artifact root.

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
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_KIND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class ArtifactError(ValueError):
    """An artifact is missing, outside the root, or does not match its recorded sha256."""


@dataclass(frozen=True)
class ArtifactInfo:
    kind: str
    path: str  # relative to the artifact root
    sha256: str
    bytes: int
    is_dir: bool = False


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_dir(path: Path) -> tuple[str, int]:
    """(hash of the sorted list of (relative path, file sha256), total bytes) of a folder."""
    h = hashlib.sha256()
    total = 0
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        h.update(f"{rel}\0{sha256_file(f)}\n".encode())
        total += f.stat().st_size
    return h.hexdigest(), total


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
        if not _KIND.match(kind):
            raise ArtifactError(f"artifact kind {kind!r}: use letters, digits, '_', '-', '.'")

    # -- tensors ----------------------------------------------------------------------------
    def save_tensors(
        self,
        job_id: int,
        kind: str,
        tensors: dict[str, Any],
        metadata: dict[str, str] | None = None,
    ) -> ArtifactInfo:
        """Write {name: tensor} as <root>/<job_id>/<kind>.safetensors atomically."""
        from safetensors.torch import save

        self._check_kind(kind)
        seen: set[int] = set()
        clean: dict[str, Any] = {}
        for name, t in tensors.items():
            t = t.detach().to("cpu").contiguous()
            if t.data_ptr() in seen and t.numel() > 0:  # safetensors refuses shared storage
                t = t.clone()
            seen.add(t.data_ptr())
            clean[name] = t
        data = save(clean, metadata=metadata)
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
            raise ArtifactError(f"artifact {rel_path!r} is missing from the artifact store")
        key = (str(full), sha256)
        fp = _fingerprint(full)
        if _VERIFIED.get(key) != fp:
            self.verify(rel_path, sha256)
            _VERIFIED[key] = fp
        return full


_VERIFIED: dict[tuple[str, str], tuple[Any, ...]] = {}  # (path, sha256) -> file fingerprint


def _fingerprint(path: Path) -> tuple[Any, ...]:
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


def open_store(settings: Any) -> ArtifactStore:
    """The artifact store the settings name: the one constructor every reader and writer uses
    (web, worker, CLI), so that the backend is chosen in one place."""
    return ArtifactStore(settings.artifacts_dir)
