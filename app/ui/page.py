"""Page-level handlers: what the URL asks for on load, the model lists, the one poll per tick, and
the small browser scripts that keep the address bar copyable."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import gradio as gr

from app.ui import compare, jobs, result, tokens
from app.ui.common import chosen_model, model_dropdown, model_names, ref_choices
from app.ui.formtab import costs

log = logging.getLogger(__name__)

TABS = ("new", "jobs", "result", "tokens", "compare", "models")
URL_JS = """(u) => {
  if (!u) { return u; }
  // a share link (/r/<token>) is a read-only view: only the result tab is offered
  document.body.classList.toggle('fl-readonly', u.startsWith('/r/'));
  if (u.includes('tab=compare')) { window.__flCompareUrl = u; } else { window.__flResultUrl = u; }
  if (window.location.pathname + window.location.search !== u) { window.history.replaceState(null, '', u); }
  return u;
}"""
COPY_JS = """(u) => {
  const full = u ? new URL(u, window.location.origin).href : window.location.href;
  if (navigator.clipboard) { navigator.clipboard.writeText(full).catch(() => {}); }
  const b = document.querySelector('#fl-copy');
  if (b) { const t = b.innerText; b.innerText = 'Copied!'; setTimeout(() => { b.innerText = t; }, 1500); }
  return u;
}"""


def bind(fn: Callable[..., Any], *first: Any) -> Callable[..., Any]:
    """`fn` with its first arguments fixed (settings, ...), keeping the signature and type hints
    of the rest, so Gradio still sees the inputs and injects gr.Request (functools.partial hides
    both)."""
    params = list(inspect.signature(fn).parameters.values())[len(first):]

    @functools.wraps(fn)
    def bound(*args: Any, **kw: Any) -> Any:
        return fn(*first, *args, **kw)

    bound.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return bound


def query(request: gr.Request | None) -> dict[str, str]:
    return dict(request.query_params) if request is not None else {}


def _float(v: str | None, default: float) -> float:
    try:
        f = float(v) if v else default
    except ValueError:
        return default
    return f if 0 < f <= 100 else default


def on_load(settings: Any, request: gr.Request) -> list[Any]:
    """Everything the URL asks for, in one round trip: /r/<token> arrives as ?view=<token>
    (read-only), ?r=<token> (a result), ?tab=, ?a=&b= (compare). Updates for: tabs, view token,
    readonly, shared banner, result picker row, the other five tabs' visibility, the compare
    dropdowns, the result view (result.outputs) and the compare view (without its url)."""
    q = query(request)
    view = q.get("view", "")
    token = view or q.get("r", "")
    tab = "result" if token else q.get("tab", "new")
    tab = tab if tab in TABS else "new"
    readonly = bool(view)
    head = [gr.Tabs(selected=tab), token, readonly, gr.HTML(visible=readonly),
            gr.Row(visible=not readonly), *[gr.Tab(visible=not readonly) for t in TABS if t != "result"]]
    a, b = q.get("a", ""), q.get("b", "")
    if tab == "compare":
        k = _float(q.get("k"), compare.DEFAULT_K)
        pair = [*compare.compare_choices(settings, a, b), k, *compare.compare_view(settings, a, b, k)[:5]]
    else:
        pair = [gr.skip()] * 8
    shown = result.result_view(settings, token, "", readonly, force=True, base_url=result.base_of(request))
    if not readonly and not token:  # the picker is filled on load, not only after "Refresh list"
        shown[-1] = result.result_choices(settings)
    return [*head, *pair, *shown]


def refresh_models(settings: Any, optional: list[bool], *current: Any) -> list[Any]:
    """Fresh choices for every model dropdown (a model trained meanwhile appears), keeping what
    is selected; `optional[i]`: dropdown i may stay '(none)'."""
    models = model_names(settings)
    return [model_dropdown(models, v, opt) for v, opt in zip(current, optional, strict=True)]


def diff_defaults(settings: Any) -> dict[str, str]:
    """What the checkpoint diff starts with: the newest trained model against the model it was
    trained from ({"diff.base": ..., "diff.tuned": "job:N"}); nothing when no train job exists
    (base and tuned then start at the same model, and the form says to pick a tuned one)."""
    from app import services

    for t in services.trained_models(settings, limit=1):
        base = (t.get("spec") or {}).get("model")
        if base:
            return {"diff.base": str(base), "diff.tuned": t["ref"]}
    return {}


def models_and_costs(settings: Any, optional: list[bool], layout: list[tuple[str, list[str]]],
                     slots: list[tuple[int, int]], roles: list[str], *values: Any) -> list[Any]:
    """Page load: the model dropdowns (`values` starts with their current values) and the cost
    lines of the forms (`layout`, their inputs follow), in ONE event, so a cost line is never
    computed from older values than the form shows. `slots`: (position among the form inputs,
    model dropdown index) of the inputs that are model dropdowns; `roles`: each dropdown's
    "kind.field" (the diff's base and tuned start as base vs the newest trained model)."""
    boxes, inputs = values[:len(optional)], list(values[len(optional):])
    models = model_names(settings)
    starts = diff_defaults(settings)
    boxes = tuple(v or starts.get(role) for v, role in zip(boxes, roles, strict=True))
    chosen = [chosen_model(models, v, opt) for v, opt in zip(boxes, optional, strict=True)]
    for pos, box in slots:
        inputs[pos] = chosen[box]
    return [*[model_dropdown(models, v, opt) for v, opt in zip(boxes, optional, strict=True)],
            *costs(settings, layout, *inputs)]


def refresh_refs(settings: Any, kinds: list[str]) -> list[Any]:
    """The job-reference dropdowns (a Fisher for a mask, a mask for training, ...)."""
    cache: dict[str, list[tuple[str, str]]] = {}
    return [gr.Dropdown(choices=cache.setdefault(k, ref_choices(settings, k))) for k in kinds]


def poll_all(settings: Any, token: str, sig: str, readonly: bool, kind: str, status: str, last: str,
             ttoken: str, tsig: str, owner: str = "me", stoken: str = "", ssig: str = "",
             request: gr.Request | None = None) -> list[Any]:
    """One poll per tick for the whole page: result progress, jobs table, token job, the live
    line of the last submitted job."""
    try:
        return [*result.result_view(settings, token, sig, readonly, base_url=result.base_of(request)),
                *jobs.jobs_view(settings, kind, status, last, owner),
                *tokens.poll_tokens(settings, ttoken, tsig),
                *result.submitted_view(settings, stoken, ssig)]
    except Exception:  # noqa: BLE001 - e.g. a busy database: try again next tick, no modal
        log.warning("poll failed; retrying on the next tick", exc_info=True)
        return [gr.skip()] * (result.N_OUT + 2 + 4 + 2)
