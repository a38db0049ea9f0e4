"""Figures built once: a finished job's figures, tables and key numbers as one JSON file.

Results are immutable once a job has finished, so what a result view shows is built the first
time anyone asks for it (share page or UI) and kept as the artifact `<job id>/share-figures.json`
in the artifact store (storage.artifacts.open_store: the folder, written atomically, or object
storage). Every later viewer, in any process and on any machine, reads that file. The file records the job's `finished_at` and `FIGURES_KEY`, a hash of the code that draws
(this package, the result schemas, the layer x module aggregation, the plotly version): when that
code changes, the next view rebuilds it, so figures registered later show up on old results too.

Concurrent first viewers: one build per job per process (a lock per job id); two processes may
both build, and the second atomic rename wins with identical content.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plotly

from app.figures.keynumbers import key_numbers
from app.figures.labels import name_layer_cells, name_layers
from app.figures.registry import entries, figures_for, tables_for
from compute.contract import provenance
from compute.contract import results as contract
from compute.jobs import registry
from compute.lm import cells

log = logging.getLogger("fisherlens.figures")

FILENAME = "share-figures.json"
# Job fields a result page may show: never `error` (an operator-only traceback) or `worker`.
PUBLIC_JOB_FIELDS = ("id", "kind", "status", "spec", "share_token", "created_at", "started_at",
                     "finished_at", "message", "model_revision", "parent_id")


def _code_key(extra: str = "") -> str:
    h = hashlib.sha256(f"plotly {plotly.__version__}\n{extra}".encode())
    here = Path(__file__).resolve().parent
    drawing = [Path(contract.__file__).resolve(), Path(cells.__file__).resolve(),
               Path(provenance.__file__).resolve(),  # how references are labelled
               *sorted(Path(registry.__file__).resolve().parent.glob("*.py"))]  # the kinds' contracts
    for path in [*drawing, *sorted(here.glob("*.py"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


FIGURES_KEY = _code_key()


def figure_title(fig: dict[str, Any], registered: str) -> str:
    """The figure's own title (it may carry numbers), else the title it was registered with;
    never an internal figure name."""
    title = (fig.get("layout") or {}).get("title")
    text = title.get("text") if isinstance(title, dict) else title
    return str(text) if text else registered


def build_payload(result: dict[str, Any]) -> dict[str, Any]:
    """Everything a result page shows, as plain JSON: key numbers, figures (Plotly JSON with
    named layers), tables. `result` is the dict of `services.result_by_token`."""
    job = result.get("job") or {}
    kind = result.get("kind") or job.get("kind")
    typed = registry.parse_result(result) if kind in registry.KINDS else None
    titles = {e.name: e.title for e in entries(str(kind))} if typed else {}
    figures = []
    for name, fig in figures_for(typed) if typed else []:
        data = name_layers(json.loads(fig.to_json()))
        figures.append({"name": name, "title": figure_title(data, titles[name]), "figure": data})
    tables = [{"title": title, "headers": list(headers), "rows": name_layer_cells(list(headers), rows)}
              for title, (headers, rows) in (tables_for(typed) if typed else [])]
    return {
        "figures_key": FIGURES_KEY,
        "job": {k: job.get(k) for k in PUBLIC_JOB_FIELDS},
        "artifacts": [{k: a.get(k) for k in ("kind", "bytes", "is_dir")}
                      for a in result.get("artifacts") or []],
        "numbers": key_numbers(result),
        "figures": figures,
        "tables": tables,
    }


def finite_json(obj: Any) -> Any:
    """NaN/inf -> None (JSON has no NaN; a blank cell is what Plotly draws for it anyway)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_json(v) for v in obj]
    return obj


class FigureStore:
    """Read-or-build of the payload file of finished jobs in one artifact store (a folder path
    is the folder store at that root)."""

    def __init__(self, store: Any):
        from storage.artifacts import ArtifactStore

        self.store = ArtifactStore(store) if isinstance(store, Path | str) else store
        self._guard = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}

    @staticmethod
    def rel_path(job_id: int) -> str:
        return f"{int(job_id)}/{FILENAME}"

    def read(self, job_id: int, finished_at: str | None) -> dict[str, Any] | None:
        """The stored payload if it was built for this job, finish time and drawing code."""
        from storage.artifacts import ArtifactStoreUnavailable

        try:
            data = self.store.read_bytes(self.rel_path(job_id))
            payload = json.loads(data) if data is not None else None
        except (OSError, ValueError, ArtifactStoreUnavailable):
            return None
        if not isinstance(payload, dict):
            return None
        job = payload.get("job") or {}
        if (payload.get("figures_key") != FIGURES_KEY or job.get("id") != job_id
                or job.get("finished_at") != finished_at):
            return None
        return payload

    def _lock(self, job_id: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(job_id, threading.Lock())

    def get(self, job_id: int, finished_at: str | None,
            load: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        """The payload of a finished job: read it, or build it once from `load()` (the full
        result) and store it. None when `load()` finds no result (the job was deleted)."""
        payload = self.read(job_id, finished_at)
        if payload is not None:
            return payload
        with self._lock(job_id):
            payload = self.read(job_id, finished_at)  # another thread built it meanwhile
            if payload is not None:
                return payload
            result = load()
            if result is None:
                return None
            payload = build_payload(result)
            self.write(job_id, payload)
            return payload

    def write(self, job_id: int, payload: dict[str, Any]) -> None:
        """Store the payload; an object store that cannot be reached only costs a rebuild at
        the next view (the page is served from the payload in hand)."""
        from storage.artifacts import ArtifactStoreUnavailable

        data = json.dumps(finite_json(payload), separators=(",", ":"), allow_nan=False).encode()
        try:
            self.store.save_bytes(job_id, FILENAME, data)
        except ArtifactStoreUnavailable:
            log.exception("figures of job %s not stored", job_id)


_stores: dict[str, FigureStore] = {}
_stores_guard = threading.Lock()


def store_for(settings: Any) -> FigureStore:
    """One FigureStore per artifact store in this process (it holds the per-job build locks;
    no user data)."""
    from storage.artifacts import open_store

    store = open_store(settings)
    key = store.describe()
    with _stores_guard:
        if key not in _stores:
            _stores[key] = FigureStore(store)
        return _stores[key]
