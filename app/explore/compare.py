"""Compare two results that rank the same parameters: two Fishers (two seeds, two models, a base
and a trained model), two masks, a Fisher and a diff, two diffs, two series.

Each side is a score per coordinate (app/explore/sources.py: F, the mask as 0/1, |delta|). The
numbers are compute.sparsity.overlap's, the same definitions as a diff's stored Fisher-vs-update
overlap: A = the top k% of side a over all shared parameters, B = the top k% of side b (ties by
parameter name and position, compute.sparsity.masks.topk_mask), per layer x module restricted to
the cell: Jaccard |A & B| / |A | B|, its random baseline p_a p_b / (p_a + p_b - p_a p_b) for
independent sets of the cell's densities, and Spearman's rank correlation of the two scores on
the cell's coordinates (a seeded sample above DEFAULT_CAP coordinates, said so). Two masks are
compared as the sets they are (A, B = the masks; no ranking, no Spearman). The difference map:
each cell's share of its side's total score, b minus a, on one colour scale centred on 0; the two
share maps share one colour scale.

Torch is imported only here, when a comparison is first computed (the web process serves every
page without it); the result is cached in the artifact store (app/explore/view.py `cached`).
"""

from __future__ import annotations

import math
from typing import Any

from app import render
from app.explore.sources import NotReadable, Source, cell_of, job_files, open_source

DEFAULT_K = 1.0
LAYER_MODULE = "layer_module"


def _load(src: Source, names: list[str]) -> dict[str, Any]:
    """name -> float32 torch tensor of the side's scores (one tensor read at a time)."""
    import torch

    out = {}
    for n in names:
        shape = src.shape(n)
        rows = shape[0] if len(shape) > 1 else 1
        out[n] = torch.from_numpy(src.reader(n)(0, rows).reshape(shape).copy())
    return out


def shared_names(a: Source, b: Source) -> list[str]:
    """The parameters both sides hold with the same shape (file order of side a)."""
    names = [n for n in a.names() if n in b.files and a.shape(n) == b.shape(n)]
    if not names:
        raise NotReadable("b: the two results share no parameter of the same shape (different models?)")
    return names


def compare_sources(a: Source, b: Source, k_percent: float = DEFAULT_K) -> dict[str, Any]:
    """The comparison's numbers (uncached): {"overall", "cells": [{layer, module, ...}], ...}."""
    from compute.sparsity import overlap

    if not 0 < k_percent <= 100:
        raise ValueError(f"k: got {k_percent:g}; accepted: 0 < k <= 100 (percent)")
    names = shared_names(a, b)
    sa, sb = _load(a, names), _load(b, names)
    masks = a.sets and b.sets
    groups = ("global", LAYER_MODULE)
    if masks:
        res: dict[str, Any] = {g: overlap.mask_overlap(sa, sb, by=g) for g in groups}
        settings = {"sets": "the two masks", "n": sum(t.numel() for t in sa.values())}
    else:
        res = overlap.score_vs_target(sa, sb, k_percent / 100.0, by=groups)
        settings = res["settings"]
    mass_a = {g: 0.0 for g in res[LAYER_MODULE]}
    mass_b = dict(mass_a)
    for n in names:
        key = f"{'-' if cell_of(n)[0] is None else cell_of(n)[0]}/{cell_of(n)[1]}"
        mass_a[key] += float(sa[n].double().abs().sum())
        mass_b[key] += float(sb[n].double().abs().sum())
    tot_a, tot_b = sum(mass_a.values()) or 1.0, sum(mass_b.values()) or 1.0
    cells = []
    for key, m in res[LAYER_MODULE].items():
        layer, module = key.split("/", 1)
        cells.append({"layer": None if layer == "-" else int(layer), "module": module,
                      "n": int(m["n"]), "jaccard": m["jaccard"], "jaccard_baseline": m["jaccard_baseline"],
                      "jaccard_lift": m["jaccard_lift"], "spearman": m.get("spearman"),
                      "share_a": mass_a[key] / tot_a, "share_b": mass_b[key] / tot_b})
    g = res["global"]["all"]
    return {"k_percent": None if masks else k_percent, "kinds": [a.kind, b.kind], "values": [a.value, b.value],
            "parameters": len(names), "only_a": len([n for n in a.names() if n not in b.files]),
            "only_b": len([n for n in b.names() if n not in a.files]),
            "overall": {"n": int(g["n"]), "n_a": int(g["n_a"]), "n_b": int(g["n_b"]), "overlap": int(g["overlap"]),
                        "jaccard": g["jaccard"], "jaccard_baseline": g["jaccard_baseline"],
                        "jaccard_lift": g["jaccard_lift"], "spearman": g.get("spearman")},
            "settings": {k: v for k, v in settings.items() if isinstance(v, int | float | str | bool)},
            "cells": sorted(cells, key=lambda c: (c["layer"] is None, c["layer"] or 0, c["module"]))}


def compare_numbers(settings: Any, a: str, b: str, k_percent: float = DEFAULT_K) -> dict[str, Any]:
    """The comparison of the results of share tokens a and b (cached with a's artifacts)."""
    from app.explore.view import CODE_KEY, cached

    if not 0 < k_percent <= 100:
        raise ValueError(f"k: got {k_percent:g}; accepted: 0 < k <= 100 (percent)")
    ja, jb = job_files(settings, a), job_files(settings, b)
    try:
        sa = open_source(settings, ja)
    except NotReadable as exc:
        raise NotReadable(f"a: {exc}") from None
    try:
        sb = open_source(settings, jb)
    except NotReadable as exc:
        raise NotReadable(f"b: {exc}") from None
    key = f"{CODE_KEY}|{sa.sha}|{sb.sha}|{k_percent:g}"
    out = cached(settings, ja.id, "compare", key, lambda: compare_sources(sa, sb, k_percent))
    return {**out, "a": {"token": a, "id": ja.id, "kind": ja.kind}, "b": {"token": b, "id": jb.id, "kind": jb.kind}}


# ---------------------------------------------------------------- the view


def _row_label(c: dict[str, Any]) -> str:
    from app.figures.labels import layer_name

    return layer_name(c["layer"], c["module"])


def _grid(cells: list[dict[str, Any]], value: str) -> tuple[list[list[float | None]], list[str], list[str]]:
    from app.figures.common import MODULE_ORDER

    rows = list(dict.fromkeys(_row_label(c) for c in cells))
    mods = sorted({c["module"] for c in cells}, key=lambda m: (MODULE_ORDER.index(m) if m in MODULE_ORDER else 99, m))
    at = {(_row_label(c), c["module"]): c.get(value) for c in cells}
    z = [[_num(at.get((r, m))) for m in mods] for r in rows]
    return z, mods, rows


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _heatmap(cells: list[dict[str, Any]], value: str, title: str, colour: str, **trace: Any) -> dict[str, Any]:
    from app.explore.view import figure_json

    z, mods, rows = _grid(cells, value)
    tr = {"type": "heatmap", "z": z, "x": mods, "y": rows, "colorscale": colour, "hoverongaps": False,
          "hovertemplate": f"layer %{{y}}, module %{{x}}<br>{value.replace('_', ' ')} = %{{z:.4g}}<extra></extra>",
          **trace}
    return {"name": value, "title": title, "figure": figure_json(
        [tr], title, max(320, 26 * len(rows) + 150), {"title": {"text": "module type"}, "type": "category"},
        {"title": {"text": "layer"}, "type": "category", "autorange": "reversed"})}


def figures(v: dict[str, Any]) -> list[dict[str, Any]]:
    cells = v["cells"]
    k = f"top-{v['k_percent']:g}%" if v.get("k_percent") else "mask"
    out = [_heatmap(cells, "jaccard", f"{k} Jaccard per layer x module", "Viridis",
                    zmin=0, zmax=1, colorbar={"title": {"text": "Jaccard"}}),
           _heatmap(cells, "jaccard_lift", f"{k} Jaccard / random baseline per layer x module (1 = chance)",
                    "Viridis", colorbar={"title": {"text": "lift"}})]
    if any(_num(c.get("spearman")) is not None for c in cells):
        out.append(_heatmap(cells, "spearman", "Spearman rank correlation per layer x module", "RdBu",
                            zmin=-1, zmax=1, zmid=0, colorbar={"title": {"text": "Spearman"}}))
    for c in cells:
        c["share_diff"] = c["share_b"] - c["share_a"]
    top = max([abs(c["share_diff"]) for c in cells] or [0.0]) or 1.0
    out.append(_heatmap(cells, "share_diff", "Difference map: share of the total (b - a) per layer x module",
                        "RdBu", zmin=-top, zmax=top, zmid=0, colorbar={"title": {"text": "b - a"}}))
    hi = max([max(c["share_a"], c["share_b"]) for c in cells] or [1.0])
    for side in ("a", "b"):
        out.append(_heatmap(cells, f"share_{side}", f"Share of the total of {side} ({v['values'][0 if side == 'a' else 1]}),"
                            " one colour scale for a and b", "Viridis", zmin=0, zmax=hi,
                            colorbar={"title": {"text": "share"}}))
    return out


def _fmt(v: Any) -> str:
    f = _num(v)
    return "n/a" if f is None else render.significant(f)


def overall_html(v: dict[str, Any]) -> str:
    o = v["overall"]
    k = f"top-{v['k_percent']:g}%" if v.get("k_percent") else "mask"
    items = [(f"{k} Jaccard (all shared parameters)", _fmt(o["jaccard"]),
              f"random sets of the same sizes: {_fmt(o['jaccard_baseline'])}"),
             ("Jaccard / random baseline", _fmt(o["jaccard_lift"]), "1 = chance"),
             ("Spearman rank correlation", _fmt(o["spearman"]),
              "sampled coordinates" if v["settings"].get("rank_stats_sampled") else "all coordinates"),
             ("Coordinates compared", f"{o['n']:,}", f"{v['parameters']} parameters in both"),
             ("In both sets", f"{o['overlap']:,}", f"of {o['n_a']:,} (a) and {o['n_b']:,} (b)")]
    nums = "".join(f"<div><dt>{render.esc(a)}</dt><dd><span class='fl-val'>{render.esc(b)}</span>"
                   f"<span class='fl-cap'>{render.esc(c)}</span></dd></div>" for a, b, c in items)
    extra = (f"<div class='fl-banner fl-warn' role='note'>Only in a: {v['only_a']} parameters, only in b: "
             f"{v['only_b']}; they are left out.</div>" if v["only_a"] or v["only_b"] else "")
    return (f"<section id='fl-compare-key' class='fl-key'><h2>Overall</h2>{extra}"
            f"<dl class='fl-nums'>{nums}</dl></section>")


def cells_table(v: dict[str, Any]) -> str:
    rows = [[_row_label(c), c["module"], c["n"], _num(c["jaccard"]), _num(c["jaccard_baseline"]),
             _num(c["jaccard_lift"]), _num(c.get("spearman")), _num(c["share_a"]), _num(c["share_b"])]
            for c in v["cells"]]
    return render.table_html(["layer", "module", "coordinates", "Jaccard", "random baseline", "lift",
                              "Spearman", "share of a", "share of b"], rows,
                             "Per layer x module", elem_id="fl-compare-cells")


def compare_html(v: dict[str, Any], link: str = "") -> str:
    a, b = v["a"], v["b"]
    share = (f"<p class='fl-meta'>Share this comparison: <a id='fl-compare-link' href='{render.esc(link)}'>"
             f"{render.esc(link)}</a></p>" if link else "")
    head = (f"<p class='fl-meta'>a: <b>{render.esc(render.kind_title(a['kind']))} #{a['id']}</b> "
            f"({render.esc(v['values'][0])}), b: <b>{render.esc(render.kind_title(b['kind']))} #{b['id']}</b> "
            f"({render.esc(v['values'][1])})</p>")
    return (f"<div class='fl-result fl-compare' data-download='compare-{a['id']}-{b['id']}'>{head}{share}"
            f"{overall_html(v)}<section id='fl-compare-figures'><h2>Per layer x module "
            f"<a href='#' class='fl-download-figs'>download figures (SVG, zip)</a></h2>"
            f"{render.figures_html(figures(v), 'fl-cmp-fig')}</section>{cells_table(v)}</div>")
