"""The one list of what a result shows: each job kind registers its named figures and tables here,
once, in the order a reader should see them (app/figures/<kind>.py).

    @figure("fisher", "concentration", title="Concentration of the Fisher")
    def concentration(r: FisherResult) -> go.Figure | None: ...

A builder takes the typed result (compute/contract/results.py) and returns a Plotly figure, or
None when the result has nothing to draw for it (the figure is left out). `figures_for` and
`tables_for` are what the share page, the UI, the CLI's HTML report and the downloads call.
A stored heatmap is registered by its exact name with `stored_heatmap`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from compute.contract.results import TypedResult, parse_result

from .common import Table, heatmap_figure
from .labels import NO_LAYER, name_layers

FigureBuilder = Callable[[Any], go.Figure | None]
TableBuilder = Callable[[Any], Table]
KIND_MODULES = ("fisher", "mask", "train", "sweep", "retention", "diff", "tokens", "tables")


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    title: str
    build: Callable[[Any], Any]


_FIGURES: dict[str, list[Entry]] = {}
_TABLES: dict[str, list[Entry]] = {}
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


def _load() -> None:
    if not _loaded:
        for mod in KIND_MODULES:
            importlib.import_module(f"app.figures.{mod}")
        _loaded.append(True)


def entries(kind: str) -> list[Entry]:
    """The registered figures of a kind, in order (for listings and tests)."""
    _load()
    return list(_FIGURES.get(kind, []))


def as_typed(result: TypedResult[Any] | Mapping[str, Any]) -> TypedResult[Any]:
    return parse_result(result)


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
    _load()
    out = []
    for e in _TABLES.get(r.kind, []):
        t = e.build(r)
        if t[1]:
            out.append((e.title, t))
    return out
