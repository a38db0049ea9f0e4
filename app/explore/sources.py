"""Where the tensors of a stored result are, and how one of them is read.

What a kind's tensors are is declared with the kind (compute/jobs/<kind>.py `KIND.tensors`, a
compute.contract.kinds.TensorView): e.g. a Fisher's "fisher" artifact (values F, block-max pooled,
log colour), a mask's "mask" artifact (0/1, block-mean pooled: the kept fraction), a diff's
|delta|: its "delta" artifact when the diff stored one (store_delta), else |tuned - base| read
from the two checkpoints it compared (one tensor from each), a series' |delta| of its last
checkpoint against the base. A kind scored against a Fisher names that field (the overlays,
app/explore/overlay.py).

Every file is read with safetensors' `safe_open(...).get_slice(name)`, one tensor, in row chunks:
never the whole file. Readable means: the caller may read the result (share link or owner,
`app.services.results`); a job artifact is fetched through the artifact store (sha256 verified).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compute.lm.naming import layer_index, module_type


class NotReadable(LookupError):
    """The result or tensor cannot be opened (HTTP 404, the message names what is missing)."""


@dataclass(frozen=True)
class TensorFile:
    """One safetensors file and the names it holds (header only)."""

    path: Path
    names: tuple[str, ...]

    @staticmethod
    def open(path: Path | str) -> TensorFile:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as h:
            return TensorFile(Path(path), tuple(h.keys()))


def _slice_rows(path: Path, name: str, start: int, stop: int) -> np.ndarray:
    """Rows start..stop of tensor `name` (its first axis; a 1-D tensor is one row) as float32."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as h:
        sl = h.get_slice(name)
        shape = sl.get_shape()
        dtype = sl.get_dtype()
        if dtype == "BF16":  # numpy has no bfloat16: the raw bits, widened to float32
            return _bf16_rows(path, name, shape, start, stop)
        x = sl[:] if len(shape) <= 1 else sl[start:stop]
    return np.asarray(x, dtype=np.float32)


def _bf16_rows(path: Path, name: str, shape: list[int], start: int, stop: int) -> np.ndarray:
    """A bfloat16 tensor's rows from the file's header offsets (the format is: 8-byte header
    length, JSON header, raw little-endian data)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        info = json.loads(fh.read(n))[name]
    begin = 8 + n + int(info["data_offsets"][0])
    row = int(np.prod(shape[1:])) if len(shape) > 1 else int(np.prod(shape) or 1)
    if len(shape) <= 1:
        start, stop = 0, 1
    raw = np.memmap(path, dtype="<u2", mode="r", offset=begin + 2 * start * row, shape=((stop - start) * row,))
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(stop - start, row)


def shape_of(path: Path, name: str) -> tuple[int, ...]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as h:
        return tuple(int(s) for s in h.get_slice(name).get_shape())


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """name -> the safetensors file holding it, for a model folder (one file, or shards with
    model.safetensors.index.json)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return {n: folder / f for n, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise NotReadable(f"checkpoint: no safetensors files in {folder.name}")
    out: dict[str, Path] = {}
    for f in files:
        for n in TensorFile.open(f).names:
            out.setdefault(n, f)
    return out


@dataclass
class Source:
    """The tensors a result can open: name -> how to read its rows, the values' meaning, and
    the model config (heads) when the model folder is readable."""

    kind: str
    value: str  # what a value is ("Fisher", "|delta|", ...)
    pool: str  # "max" or "mean"
    log: bool  # log colour scale
    files: dict[str, list[Path]]  # name -> one file (value) or two (base, tuned: |tuned - base|)
    config: dict[str, Any] | None = None
    fisher: dict[str, Path] | None = None  # the Fisher a diff / series was scored against
    sha: str = ""  # what the values are a function of (cache key)
    sets: bool = False  # compared as sets (masks), not by rank
    notes: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return shape_of(self.files[self._known(name)][0], name)

    def _known(self, name: str) -> str:
        if name not in self.files:
            raise NotReadable(f"name: this result has no tensor {name!r}")
        return name

    def reader(self, name: str) -> Callable[[int, int], np.ndarray]:
        """read(start, stop) -> the values of rows start..stop (float32)."""
        paths = self.files[self._known(name)]
        if len(paths) == 1:
            return lambda a, b: _slice_rows(paths[0], name, a, b)
        base, tuned = paths
        return lambda a, b: np.abs(_slice_rows(tuned, name, a, b) - _slice_rows(base, name, a, b))

    def fisher_reader(self, name: str) -> Callable[[int, int], np.ndarray] | None:
        if not self.fisher or name not in self.fisher:
            return None
        path = self.fisher[name]
        return lambda a, b: _slice_rows(path, name, a, b)


def cell_of(name: str) -> tuple[int | None, str]:
    """(layer, module type) of a parameter name: the cell of a layer x module heatmap."""
    return layer_index(name), module_type(name)


_ROW_NAMES = {"embeddings": "embed", "position embeddings": "pos_embed", "final norm": "norm",
              "lm_head": "lm_head", "other (outside the blocks)": "other"}


def names_in_cell(names: list[str], layer: str, module: str) -> list[str]:
    """The tensors of one heatmap cell (in file order). `layer` is the row label as drawn ("3", or a named row outside the blocks: "embeddings", "final norm",
    "lm_head"); `module` the column label (a module type)."""
    layer = str(layer).strip()
    want = (int(layer), module) if layer.isdigit() else (None, _ROW_NAMES.get(layer, module))
    return [n for n in names if cell_of(n) == want]


# ---------------------------------------------------------------- a job's files


@dataclass(frozen=True)
class JobFiles:
    """What a source is opened from: the readable job's id, kind, finish time, artifacts
    ({kind: (store path, sha256)}) and resolved references (jobs.refs)."""

    id: int
    kind: str
    finished_at: str | None
    status: str
    artifacts: dict[str, tuple[str, str]]
    refs: dict[str, dict[str, Any]]
    share_token: str
    spec: dict[str, Any]


def job_files(settings: Any, token: str) -> JobFiles:
    """The job of a share token if this caller may read it (NotReadable otherwise)."""
    from app.services.common import sessions
    from app.services.results import readable_by_token
    from storage.models import ArtifactRow

    with sessions(settings)() as s:
        job = readable_by_token(settings, s, token)
        if job is None:
            raise NotReadable(f"token: no result with share token {token!r}")
        rows = s.query(ArtifactRow).filter(ArtifactRow.job_id == job.id).all()
        return JobFiles(int(job.id), str(job.kind), job.finished_at.isoformat() if job.finished_at else None,
                        str(job.status), {r.kind: (r.path, r.sha256) for r in rows if not r.is_dir},
                        dict(job.refs or {}), str(job.share_token), dict(job.spec or {}))


def _fetch(settings: Any, path: str, sha: str) -> Path:
    from storage.artifacts import ArtifactMissing, open_store

    try:
        return Path(open_store(settings).fetch(path, sha))
    except ArtifactMissing:
        raise NotReadable("artifact: no longer in the artifact store (deleted); re-run the job") from None


def ref_path(settings: Any, ref: dict[str, Any] | None) -> Path | None:
    """The local file or folder of a stored reference (an artifact fetched and verified; a hub
    model from the local cache), None when it is not readable here."""
    if not ref:
        return None
    form, path = ref.get("form"), str(ref.get("path") or "")
    if form == "artifact":
        return _fetch(settings, path, str(ref.get("sha256") or ""))
    if form == "hub":
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(path, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
        except Exception:  # noqa: BLE001 - not in the local cache: not readable here
            return None
    p = Path(path)
    return p if p.exists() else None


def _config(folder: Path | None) -> dict[str, Any] | None:
    if folder is None:
        return None
    f = folder / "config.json" if folder.is_dir() else folder.parent / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    text = cfg.get("text_config")  # multimodal configs (Gemma 3) keep the LM's under text_config
    return {**cfg, **text} if isinstance(text, dict) else cfg


def last_checkpoint(run_dir: Path) -> Path:
    steps = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := re.match(r"^checkpoint-(\d+)$", p.name))]
    if not steps:
        raise NotReadable("run_dir: no checkpoint-<step> folder to read")
    return max(steps)[1]


def _single(path: Path) -> dict[str, list[Path]]:
    return {n: [path] for n in TensorFile.open(path).names}


def _pair(base: Path, tuned: Path) -> dict[str, list[Path]]:
    b, t = checkpoint_files(base), checkpoint_files(tuned)
    return {n: [b[n], t[n]] for n in t if n in b and shape_of(b[n], n) == shape_of(t[n], n)}


def tensor_view(kind: str) -> Any:
    """The kind's TensorView (compute/jobs/<kind>.py `KIND.tensors`), or NotReadable."""
    from compute.jobs import registry

    k = registry.KINDS.get(kind)
    if k is None or k.tensors is None:
        openable = ", ".join(n for n, v in registry.KINDS.items() if v.tensors is not None)
        raise NotReadable(f"kind: a {kind} result has no tensors to open; accepted: {openable}")
    return k.tensors


def open_source(settings: Any, jf: JobFiles) -> Source:
    """The Source of a readable succeeded job whose kind declares a TensorView (NotReadable
    otherwise, naming what is missing)."""
    tv = tensor_view(jf.kind)
    if jf.status != "succeeded":
        raise NotReadable(f"status: the job is {jf.status}; tensors open once it has succeeded")
    art, refs = jf.artifacts, jf.refs
    sha = ",".join(f"{k}={v[1]}" for k, v in sorted(art.items()))
    sha += "," + ",".join(f"{k}={(r or {}).get('sha256') or (r or {}).get('path')}" for k, r in sorted(refs.items()))
    config = _config(ref_path(settings, refs.get(tv.config_field))) if tv.config_field else None
    fisher = None
    fisher_path = ref_path(settings, refs.get(tv.fisher_field)) if tv.fisher_field else None
    if fisher_path is not None and fisher_path.is_file():
        fisher = {n: fisher_path for n in TensorFile.open(fisher_path).names}

    def source(files: dict[str, list[Path]], note: str = "") -> Source:
        src = Source(jf.kind, tv.value, tv.pool, tv.log, files, config, fisher, sha, sets=tv.sets)
        if note:
            src.notes.append(note)
        return _absolute(src) if tv.absolute and len(next(iter(files.values()), [])) == 1 else src

    if tv.artifact and tv.artifact in art:
        return source(_single(_fetch(settings, *art[tv.artifact])),
                      f"values: |{tv.artifact}| of the stored {tv.artifact} tensors" if tv.absolute else "")
    if tv.pair is None:
        raise NotReadable(f"artifact: this {jf.kind} result stored no {tv.artifact} tensors")
    base_field, tuned_field = tv.pair
    base = ref_path(settings, refs.get(base_field))
    if base is None:
        raise NotReadable(f"{base_field}: the model of this result is not readable on this server")
    tuned = ref_path(settings, refs.get(tuned_field))
    if tuned is None or not tuned.is_dir():
        raise NotReadable(f"{tuned_field}: the checkpoint of this result is not readable on this server")
    if tv.last_checkpoint:
        tuned = last_checkpoint(tuned)
    return source(_pair(base, tuned), f"values: |{tuned.name} - {base_field}| in float32, read from both checkpoints")


def _absolute(src: Source) -> Source:
    """A stored signed delta shown as |delta| (the reader takes the absolute value)."""
    inner = src.reader

    def reader(name: str) -> Callable[[int, int], np.ndarray]:
        read = inner(name)
        return lambda a, b: np.abs(read(a, b))

    src.reader = reader  # type: ignore[method-assign]
    return src
