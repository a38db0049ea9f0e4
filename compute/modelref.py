"""Model references: zoo name, local HF directory (inside the allowed roots), or hub id.

No torch here: the web process validates model references with this module.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

ZOO_NAMES = ("arith-base", "arith-teacher")

# org/name on the Hugging Face hub (no path tricks: no leading dot, no '..', exactly one '/').
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

# Files whose content defines the model's behaviour (hashed by model_revision).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_EXTRA_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")

_file_digests: dict[tuple[str, int, int], str] = {}  # (path, mtime_ns, size) -> sha256


def _settings(settings: Any | None) -> Any:
    if settings is None:
        from app.settings import get_settings

        settings = get_settings()
    return settings


def _looks_like_path(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~", "\\")) or ref in (".", "..") or "\\" in ref


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def _local_dir(ref: str, roots: list[Path]) -> str:
    raw = Path(ref).expanduser()
    resolved_roots = [Path(r).expanduser().resolve() for r in roots]
    shown = ", ".join(str(r) for r in resolved_roots) or "(none)"
    if ".." in raw.parts:
        raise ValueError(
            f"model: {ref!r} contains '..'; give a path inside the allowed roots: {shown}"
        )
    resolved = raw.resolve()  # follows symlinks, so a link inside a root to outside is rejected
    if not _inside(resolved, resolved_roots):
        raise ValueError(
            f"model: local directory {ref!r} is outside the allowed model roots ({shown}); "
            "the operator can add folders with ALLOWED_MODEL_ROOTS=/a:/b"
        )
    if not resolved.is_dir():
        raise ValueError(f"model: local directory {ref!r} does not exist")
    if not (resolved / "config.json").is_file():
        raise ValueError(f"model: {ref!r} is not a Hugging Face model directory (no config.json)")
    return str(resolved)


def resolve_model(ref: str, settings: Any | None = None) -> str:
    """Zoo name -> its folder; local dir (inside settings.model_roots) -> resolved path;
    hub id ``org/name`` -> unchanged. Anything else: ValueError "model: ..."."""
    settings = _settings(settings)
    if not isinstance(ref, str) or not ref.strip():
        raise ValueError(
            "model: empty model reference; give a zoo name, a local directory or org/name"
        )
    ref = ref.strip()
    zoo_dir = Path(settings.zoo_dir).expanduser().resolve()
    if ref in ZOO_NAMES or (
        re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", ref)
        and (zoo_dir / ref / "config.json").is_file()
    ):
        path = zoo_dir / ref
        if not (path / "config.json").is_file():
            raise ValueError(f"model: zoo model {ref!r} is not built; run `fisherlens zoo build`")
        return str(path)
    roots = list(settings.model_roots)
    if _looks_like_path(ref) or Path(ref).expanduser().exists():
        return _local_dir(ref, roots)
    if _HUB_ID.match(ref) and ".." not in ref:
        return ref
    raise ValueError(
        f"model: unknown model {ref!r}; accepted: a zoo name ({', '.join(ZOO_NAMES)}), "
        "a local HF directory inside the allowed roots "
        f"({', '.join(str(r) for r in roots) or 'none'}), or a hub id org/name"
    )


def is_hub_id(resolved: str) -> bool:
    return not Path(resolved).is_absolute() and bool(_HUB_ID.match(resolved))


def _file_sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    digest = _file_digests.get(key)
    if digest is None:
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = h.hexdigest()
        _file_digests[key] = digest
    return digest


def model_revision(ref: str, settings: Any | None = None) -> str:
    """Content hash (sha256 hex) of a local model's config, tokenizer and weight files; the hub
    id itself for hub models. Per-file digests are cached by (path, mtime, size)."""
    resolved = resolve_model(ref, settings)
    if is_hub_id(resolved):
        return resolved
    folder = Path(resolved)
    files = sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and (p.name in _EXTRA_FILES or p.name.endswith(_WEIGHT_SUFFIXES))
    )
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{_file_sha256(p)}\n".encode())
    return h.hexdigest()
