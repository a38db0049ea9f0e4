"""The one list of what a result shows: each job kind registers its named figures, tables and key
numbers here, once, in the order a reader should see them (app/figures/<kind>.py, loaded for
every kind of compute.jobs.registry; app/figures/tables.py registers what every kind shows).

    @figure("fisher", "concentration", title="Concentration of the Fisher")
    def concentration(r: FisherResult) -> go.Figure | None: ...

A builder takes the typed result (compute/contract/results.py) and returns a Plotly figure, or
None when the result has nothing to draw for it (the figure is left out). `figures_for` and
`tables_for` are what the share page, the UI, the CLI's HTML report and the downloads call.
A stored heatmap is registered by its exact name with `stored_heatmap`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from compute.contract.results import TypedResult
from compute.jobs import registry as kinds

from .common import Table, heatmap_figure
from .labels import NO_LAYER, name_layers

FigureBuilder = Callable[[Any], go.Figure | None]
TableBuilder = Callable[[Any], Table]
KeyNumbersBuilder = Callable[[Any, dict[str, Any]], None]
EVERY_KIND = "*"  # registered for every kind, after the kind's own entries
SHARED_MODULES = ("tables", "tensor_table")  # builders for every kind (EVERY_KIND), the per-tensor table


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    title: str
    build: Callable[[Any], Any]


_FIGURES: dict[str, list[Entry]] = {}
_TABLES: dict[str, list[Entry]] = {}
_KEY_NUMBERS: dict[str, KeyNumbersBuilder] = {}
_loaded: list[bool] = []


def _register(book: dict[str, list[Entry]], kinds: str | tuple[str, ...], name: str, title: str,
              build: Callable[[Any], Any]) -> None:
    for kind in (kinds,) if isinstance(kinds, str) else kinds:
        entries = book.setdefault(kind, [])
        if any(e.name == name for e in entries):
            raise ValueError(f"figure name {name!r} is registered twice for kind {kind!r}")
        entries.append(Entry(kind, name, title, build))


def figure(kinds: str | tuple[str, ...], name: str, *, title: str) -> Callable[[FigureBuilder], FigureBuilder]:
    """Register a figure builder under `name` for one kind (or several)."""
    def deco(fn: FigureBuilder) -> FigureBuilder:
        _register(_FIGURES, kinds, name, title, fn)
        return fn
    return deco


def table(kinds: str | tuple[str, ...], name: str, *, title: str) -> Callable[[TableBuilder], TableBuilder]:
    """Register a table builder ((headers, rows); no rows = left out)."""
    def deco(fn: TableBuilder) -> TableBuilder:
        _register(_TABLES, kinds, name, title, fn)
        return fn
    return deco


def stored_heatmap(kind: str, name: str, *, title: str, log: bool | None = None) -> None:
    """Register the stored heatmap `name` of `kind`, drawn as it is (pooled when large)."""
    def build(r: TypedResult[Any]) -> go.Figure | None:
        hm = r.heatmap(name)
        return heatmap_figure(hm, str(hm.meta.get("title") or title), log=log) if hm else None
    _register(_FIGURES, kind, name, title, build)


def key_numbers(kind: str) -> Callable[[KeyNumbersBuilder], KeyNumbersBuilder]:
    """Register the key-numbers builder of `kind`: build(typed result, out) fills out's "items",
    "warnings", "verdict" and "table" (app/figures/keynumbers.py)."""
    def deco(fn: KeyNumbersBuilder) -> KeyNumbersBuilder:
        if kind in _KEY_NUMBERS:
            raise ValueError(f"key numbers are registered twice for kind {kind!r}")
        _KEY_NUMBERS[kind] = fn
        return fn
    return deco


def figure_module(kind: str) -> str:
    """The module holding a kind's figures, tables and key numbers."""
    return f"app.figures.{kind}"


def _load() -> None:
    if not _loaded:
        for kind in kinds.NAMES:
            if importlib.util.find_spec(figure_module(kind)) is not None:
                importlib.import_module(figure_module(kind))
        for mod in SHARED_MODULES:
            importlib.import_module(f"app.figures.{mod}")
        _loaded.append(True)


def _of(book: dict[str, list[Entry]], kind: str) -> list[Entry]:
    return [*book.get(kind, []), *book.get(EVERY_KIND, [])]


def entries(kind: str) -> list[Entry]:
    """The registered figures of a kind, in order (for listings and tests)."""
    _load()
    return _of(_FIGURES, kind)


def table_entries(kind: str) -> list[Entry]:
    """The registered tables of a kind, in order."""
    _load()
    return _of(_TABLES, kind)


def key_numbers_builder(kind: Any) -> KeyNumbersBuilder | None:
    """The kind's key-numbers builder, or None (an unknown kind, or none registered)."""
    _load()
    return _KEY_NUMBERS.get(kind) if isinstance(kind, str) else None


def as_typed(result: TypedResult[Any] | Mapping[str, Any]) -> TypedResult[Any]:
    return kinds.parse_result(result)


def _has_unnamed_layer(fig: go.Figure) -> bool:
    return any(NO_LAYER in list(getattr(tr, ax, None) or ()) for tr in fig.data for ax in ("x", "y"))


def titled_figures_for(result: TypedResult[Any] | Mapping[str, Any]) -> list[tuple[str, str, go.Figure]]:
    """(name, title, figure) for everything this result can show, in registration order. Rows
    and bars outside the transformer blocks carry their names ("embeddings", "final norm",
    "lm_head"), never "-"; the title is the figure's own (it may carry numbers), else the
    registered one: a view shows the title, never the internal name."""
    r = as_typed(result)
    out = []
    for e in entries(r.kind):
        fig = e.build(r)
        if fig is not None:
            if _has_unnamed_layer(fig):  # rare: rebuilt from its JSON with the rows named
                fig = go.Figure(name_layers(fig.to_dict()))
            title = fig.layout.title.text if fig.layout.title and fig.layout.title.text else e.title
            out.append((e.name, str(title), fig))
    return out


def figures_for(result: TypedResult[Any] | Mapping[str, Any]) -> list[tuple[str, go.Figure]]:
    """(name, figure) for everything this result can show, in registration order (as
    `titled_figures_for`)."""
    return [(name, fig) for name, _, fig in titled_figures_for(result)]


def tables_for(result: TypedResult[Any] | Mapping[str, Any]) -> list[tuple[str, Table]]:
    """(title, (headers, rows)) for every registered table with rows, in registration order."""
    r = as_typed(result)
    out = []
    for e in table_entries(r.kind):
        t = e.build(r)
        if t[1]:
            out.append((e.title, t))
    return out
