"""/api/results/{token}/tensors, /tensor and /tensor/view (the drill-down), /api/compare (two
results compared): JSON, readable by whoever may read the result (a share link, or the owner),
like every /api/results route."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query

from app.explore.sources import NotReadable

NAME = Query(..., min_length=1, max_length=300, description="parameter name, e.g. model.layers.0.self_attn.q_proj.weight")


def _404(exc: Exception) -> HTTPException:
    return HTTPException(status_code=404, detail=str(exc))


def make_router(settings: Any) -> APIRouter:
    from app.api import responses

    r = APIRouter(prefix="/api", tags=["explore"], responses=responses(401, 403, 404, 422, 500))

    @r.get("/results/{token}/tensors", summary="The tensors of a result (of one heatmap cell)")
    def list_tensors(token: str, layer: str | None = Query(None, max_length=64, description="row label: a block index or 'embeddings', 'final norm', 'lm_head'"),
                     module: str | None = Query(None, max_length=64, description="module type (column label)")) -> Any:
        from app.explore.view import cell_tensors

        try:
            return cell_tensors(settings, token, layer, module)
        except NotReadable as exc:
            raise _404(exc) from None

    @r.get("/results/{token}/tensor", summary="One tensor opened: pooled map, marginals, histogram, top coordinates")
    def get_tensor(token: str, name: str = NAME) -> Any:
        from app.explore.view import tensor_numbers

        try:
            return tensor_numbers(settings, token, name)
        except NotReadable as exc:
            raise _404(exc) from None

    @r.get("/results/{token}/tensor/view", summary="One tensor opened, as the HTML block the pages insert")
    def get_tensor_view(token: str, name: str | None = Query(None, max_length=300),
                        layer: str | None = Query(None, max_length=64),
                        module: str | None = Query(None, max_length=64)) -> Any:
        from app.explore.view import cell_tensors, tensor_numbers, view_html

        try:
            cell = None
            if name is None:
                if layer is None:
                    from app.api import spec_error_response
                    from compute.contract.specs import SpecError

                    return spec_error_response(SpecError([{"field": "name", "message":
                                                            "give a tensor name, or layer and module of a cell"}]))
                cell = cell_tensors(settings, token, layer, module)["tensors"]
                if not cell:
                    raise NotReadable(f"layer, module: no tensor of this result is in cell ({layer}, {module})")
                name = cell[0]["name"]
            v = tensor_numbers(settings, token, name)
            return {"name": name, "cached": v.get("cached"), "html": view_html(v, cell)}
        except NotReadable as exc:
            raise _404(exc) from None

    add_compare_routes(r, settings)
    return r


def add_compare_routes(r: APIRouter, settings: Any) -> None:
    """/api/results/{a}/compare/{b}: the comparison's numbers (JSON)."""

    @r.get("/results/{a}/compare/{b}", summary="Compare two results: top-k Jaccard, Spearman per layer x module")
    def get_compare(a: str, b: str, k: float = Query(1.0, gt=0, le=100, description="top-k percent")) -> Any:
        from app.explore.compare import compare_numbers

        try:
            return compare_numbers(settings, a, b, k)
        except NotReadable as exc:
            raise _404(exc) from None


def make_page_router(settings: Any) -> APIRouter:
    """/r/{a}/compare/{b}: the comparison as a page anyone holding both share links can open."""
    from fastapi.responses import HTMLResponse

    r = APIRouter()

    @r.get("/r/{a}/compare/{b}", include_in_schema=False)
    def compare_page(a: str, b: str, k: float = Query(1.0, gt=0, le=100)) -> Any:
        from app import render
        from app.explore.compare import compare_html, compare_numbers
        from app.share import PAGE_CSS, PLOTLY_URL

        try:
            v = compare_numbers(settings, a, b, k)
            body = compare_html(v, f"/r/{a}/compare/{b}?k={k:g}")
            status = 200
        except NotReadable as exc:
            body, status = f"<p class='fl-failed' id='fl-status'>Cannot compare: {render.esc(exc)}</p>", 404
        page = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>fisherlens: compare</title>'
                f"<style>{PAGE_CSS}{render.CSS}</style><script src=\"{PLOTLY_URL}\" defer></script>"
                f"<script>{render.PAGE_DRAW_JS}</script></head><body class='fl-share'><main>"
                f"<div class='fl-shared'>Shared comparison (read-only) &middot; <a href='/?tab=compare&a={render.esc(a)}"
                f"&b={render.esc(b)}'>open it in the explorer</a></div><h1>Compare</h1>{body}</main></body></html>")
        return HTMLResponse(page, status_code=status)

    return r
