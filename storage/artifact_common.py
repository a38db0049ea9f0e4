"""What both artifact-store backends share (storage.artifacts: the folder; storage.s3store:
object storage): the errors, ArtifactInfo, the sha256 of files and folders, the safetensors
bytes of a tensor dict, and the upload-retry context a worker publishes in."""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARTIFACT_KIND_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class ArtifactError(ValueError):
    """An artifact is missing, outside the root, or does not match its recorded sha256."""


class ArtifactMissing(ArtifactError):
    """The artifact is not (or no longer) in the store."""


class ArtifactStoreUnavailable(RuntimeError):
    """The artifact store cannot be reached or used (object store down, bucket missing, bad
    credentials). `transient`: worth retrying (connection refused, 5xx) vs a configuration
    error."""

    def __init__(self, message: str, transient: bool = True):
        super().__init__(message)
        self.transient = transient


# Inside `upload_retries(...)` (a worker publishing a job's result) a transient store error is
# retried, backing off, for that many seconds, reporting each wait to `notify`; elsewhere (the
# web) it fails at once. `on_uploaded(hook)`: hook(key) after each object is uploaded and verified
# (the worker routes it to a test-only fault point).
_retry: contextvars.ContextVar[tuple[float, Callable[[str], None] | None] | None] = (
    contextvars.ContextVar("fisherlens_artifact_retry", default=None)
)
_uploaded: contextvars.ContextVar[Callable[[str], object] | None] = contextvars.ContextVar(
    "fisherlens_artifact_uploaded", default=None
)


@contextlib.contextmanager
def upload_retries(seconds: float, notify: Callable[[str], None] | None = None) -> Iterator[None]:
    token = _retry.set((float(seconds), notify))
    try:
        yield
    finally:
        _retry.reset(token)


@contextlib.contextmanager
def on_uploaded(hook: Callable[[str], object] | None) -> Iterator[None]:
    token = _uploaded.set(hook)
    try:
        yield
    finally:
        _uploaded.reset(token)


def retry_policy() -> tuple[float, Callable[[str], None] | None] | None:
    return _retry.get()


def uploaded_hook() -> Callable[[str], object] | None:
    return _uploaded.get()


def check_kind(kind: str) -> None:
    if not ARTIFACT_KIND_PATTERN.match(kind):
        raise ArtifactError(f"artifact kind {kind!r}: use letters, digits, '_', '-', '.'")


def tensors_bytes(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """{name: tensor} as safetensors bytes (CPU, contiguous; shared storage cloned)."""
    from safetensors.torch import save

    seen: set[int] = set()
    clean: dict[str, Any] = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen and t.numel() > 0:  # safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        clean[name] = t
    return bytes(save(clean, metadata=metadata))


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
