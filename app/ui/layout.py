"""The Gradio Blocks explorer: `build_ui(settings) -> gr.Blocks`.

Order: pure helpers (HTML snippets, form -> spec dicts), handlers, layout, event wiring.
No mutable module-level state (shared by all users); per-user state lives in gr.State.
No torch: jobs go through app.services (the worker computes), figures come from app.plots.
The address bar follows what is shown (a hidden textbox whose change runs history.replaceState),
so it can always be copied: /r/<token> (read-only result), /?tab=..., /?tab=compare&a=..&b=...
"""

from __future__ import annotations

import html
import json
import logging
from typing import Any
from urllib.parse import urlencode

import gradio as gr
from gradio.components.plot import PlotData

from app import api, auth, limits, plots, services
from app.figures.store import store_for
from compute.specs import SPECS, SpecError
from storage.models import FINAL_STATUSES, JOB_STATUSES

log = logging.getLogger(__name__)

N_OPTIONAL_MODELS = 3  # model dropdowns that may stay empty: teacher (train, retention), tuned
MAX_FIGS = 8  # figure slots in the result view
MAX_TABLES = 4
COMPARE_FIGS = 4
POLL_S = 1.5
TABS = ("new", "jobs", "result", "tokens", "compare", "models")
TASKS = ["arithmetic", "arithmetic-add", "arithmetic-mul"]
SELECTORS = ["fisher", "fisher-tensor", "fisher-bottom", "random", "magnitude", "magnitude-bottom",
             "gradient"]

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


# ---------------------------------------------------------------- HTML snippets (pure)


def esc(v: Any) -> str:
    return html.escape("" if v is None else str(v))


def job_model(job: dict[str, Any]) -> str:
    spec = job.get("spec") or {}
    for k in ("model", "base", "fisher"):
        if spec.get(k):
            return str(spec[k])
    return ""


def job_label(job: dict[str, Any]) -> str:
    return f"#{job['id']} {job['kind']} {job_model(job)} ({job['status']})".replace("  ", " ")


def progress_html(job: dict[str, Any] | None) -> str:
    """A progress bar with data-status / data-progress attributes (tests wait on them)."""
    if job is None:
        return "<div class='fl-progress' data-status='none'><div class='fl-label'>no job selected</div></div>"
    status = job.get("status", "queued")
    frac = float(job.get("progress") or 0.0)
    if status == "succeeded":
        frac = 1.0
    pct = max(0.0, min(100.0, 100.0 * frac))
    msg = services.public_message(job.get("message"))  # one line; the traceback is operator-only
    out = (
        f"<div class='fl-progress' data-status='{esc(status)}' data-progress='{frac:.4f}' "
        f"data-job='{esc(job.get('id'))}'>"
        f"<div class='fl-bar'><div class='fl-fill fl-{esc(status)}' style='width:{pct:.1f}%'></div></div>"
        f"<div class='fl-label'><b>#{esc(job.get('id'))} {esc(job.get('kind'))}</b> "
        f"<span class='fl-status fl-{esc(status)}'>{esc(status)}</span> {pct:.0f}% &middot; {esc(msg)}</div>"
    )
    return out + "</div>"


def errors_html(errors: list[dict[str, str]], title: str = "Not submitted (nothing was queued)") -> str:
    items = "".join(f"<li><b>{esc(e.get('field'))}</b>: {esc(e.get('message'))}</li>" for e in errors)
    return f"<div class='fl-errors' role='alert'><b>{esc(title)}</b>:<ul>{items}</ul></div>"


def note_html(text: str, kind: str = "ok") -> str:
    return f"<div class='fl-note fl-note-{esc(kind)}'>{text}</div>"


def jobs_table_html(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "<div class='fl-note'>No jobs yet. Submit one in <b>New job</b>.</div>"
    rows = []
    for j in jobs:
        frac = 1.0 if j["status"] == "succeeded" else float(j.get("progress") or 0.0)
        rows.append(
            f"<tr data-job='{j['id']}' data-status='{esc(j['status'])}'>"
            f"<td>{j['id']}</td><td>{esc(j['kind'])}</td><td>{esc(job_model(j))}</td>"
            f"<td><span class='fl-status fl-{esc(j['status'])}'>{esc(j['status'])}</span></td>"
            f"<td><div class='fl-bar fl-bar-sm'><div class='fl-fill fl-{esc(j['status'])}' "
            f"style='width:{100 * frac:.0f}%'></div></div></td>"
            f"<td class='fl-msg'>{esc(j.get('message'))}</td><td>{esc((j.get('created_at') or '')[:19])}</td>"
            f"<td><a href='/?{urlencode({'tab': 'result', 'r': j['share_token']})}'>open</a> &middot; "
            f"<a href='/r/{esc(j['share_token'])}' target='_blank'>share</a></td></tr>"
        )
    return ("<table class='fl-jobs'><thead><tr><th>id</th><th>kind</th><th>model</th><th>status</th>"
            "<th>progress</th><th>message</th><th>created (UTC)</th><th></th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def downloads_html(result: dict[str, Any]) -> str:
    job = result.get("job") or {}
    token = esc(job.get("share_token"))
    links = [f"<a href='/api/results/{token}/stats.csv' download>stats CSV</a>",
             f"<a href='/api/results/{token}/stats.json' download>stats JSON</a>",
             f"<a href='/api/results/{token}' target='_blank'>raw JSON</a>"]
    for a in result.get("artifacts") or []:
        ext = "zip" if a.get("is_dir") else "safetensors"
        size = a.get("bytes") or 0
        links.append(f"<a href='/api/results/{token}/artifacts/{esc(a['kind'])}' download>"
                     f"{esc(a['kind'])} ({ext}, {size / 1e6:.2f} MB)</a>")
    return "<div class='fl-downloads'>Downloads: " + " &middot; ".join(links) + "</div>"


def spec_html(job: dict[str, Any]) -> str:
    spec = job.get("spec") or {}
    cells = " ".join(f"<span class='fl-kv'><b>{esc(k)}</b>={esc('none' if v is None else v)}</span>"
                     for k, v in spec.items())
    when = esc((job.get("finished_at") or job.get("created_at") or "")[:19])
    return f"<div class='fl-spec'><b>{esc(job.get('kind'))}</b> job #{esc(job.get('id'))} ({when} UTC): {cells}</div>"


def not_found_html(token: str) -> str:
    return note_html(f"No result found for <code>{esc(token)}</code>: the link may be mistyped, or "
                     "the result was deleted.", "error")


# ---------------------------------------------------------------- form values -> spec dicts (pure)


def clean_spec(values: dict[str, Any]) -> dict[str, Any]:
    """Drop blanks (None, "", []) so spec defaults apply; whole floats for int fields stay as
    given (pydantic rejects 1.5 for an int with a clear message, and accepts 2.0)."""
    out = {}
    for k, v in values.items():
        if v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
            continue
        if isinstance(v, float) and v.is_integer() and _is_int_field(k):
            v = int(v)
        out[k] = v.strip() if isinstance(v, str) else v
    return out


def _is_int_field(name: str) -> bool:
    for cls in SPECS.values():
        f = cls.model_fields.get(name)
        if f is not None and "int" in str(f.annotation) and "float" not in str(f.annotation):
            return True
    return False


def opt_number(text: Any, field: str, integer: bool = False) -> int | float | None:
    """Blank -> None (the spec default); else the number; SpecError naming `field` otherwise."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise SpecError([{"field": field, "message": f"got {text!r}; give a number or leave it blank"}]) from None
    if integer:
        if not value.is_integer():
            raise SpecError([{"field": field, "message": f"got {text!r}; give a whole number or leave it blank"}])
        return int(value)
    return value


def parse_float_list(text: str | None, field: str) -> list[float] | None:
    if text is None or not str(text).strip():
        return None
    try:
        return [float(x) for x in str(text).replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise SpecError([{"field": field, "message": f"got {text!r}; give numbers separated by commas, "
                                                      "e.g. 0.01,0.05,0.1"}]) from None


# ---------------------------------------------------------------- build_ui


def build_ui(settings: Any) -> gr.Blocks:  # noqa: C901 - layout + wiring read top to bottom
    """The whole explorer for `settings` (a fisherlens Settings)."""

    # ------------------------------------------------------------ handlers (no shared state)

    def model_names() -> list[tuple[str, str]]:
        """(label, ref) for every model dropdown: zoo names, registered folders and trained
        models ('#6 train arith-base grpo masked' -> job:6), as any model field accepts them."""
        try:
            return [(m.get("label") or m["name"], m["ref"]) for m in api.all_models(settings)]
        except Exception:  # noqa: BLE001 - a broken zoo folder must not break the page
            log.warning("listing models failed", exc_info=True)
            return []

    def model_dropdowns(*current: Any) -> list[Any]:
        """Fresh choices for the model dropdowns (a model trained meanwhile appears), keeping
        what is selected; the optional ones (teacher, tuned) start with '(none)'."""
        models = model_names()
        n_opt = N_OPTIONAL_MODELS
        out = [gr.Dropdown(choices=models, value=v or (models[0][1] if models else None))
               for v in current[: len(current) - n_opt]]
        out += [gr.Dropdown(choices=[("(none)", ""), *models], value=v or "") for v in current[-n_opt:]]
        return out

    def job_choices(kind: str | None = None, succeeded_only: bool = False) -> list[tuple[str, str]]:
        jobs = services.list_jobs(settings, limit=100, kind=kind or None,
                                  status="succeeded" if succeeded_only else None)
        return [(job_label(j), j["share_token"]) for j in jobs]

    def ref_choices(kind: str) -> list[tuple[str, str]]:
        return [("(none)", "")] + [(job_label(j), f"job:{j['id']}") for j in
                                   services.list_jobs(settings, limit=100, kind=kind, status="succeeded")]

    def do_submit(kind: str, data: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        try:
            job = services.submit(settings, kind, data)
        except SpecError as exc:
            return None, errors_html(exc.errors)
        except Exception as exc:  # noqa: BLE001 - shown to the user, never a traceback
            return None, note_html(f"Could not submit: {esc(exc)}", "error")
        what = "Reused the stored result of an identical job" if job.get("reused") else "Queued"
        return job, note_html(f"{what}: job #{job['id']} ({esc(kind)}).")

    def submit_and_show(kind: str, data: dict[str, Any]):
        job, msg = do_submit(kind, data)
        if job is None:
            return msg, gr.skip(), gr.skip()
        return msg, job["share_token"], gr.Tabs(selected="result")

    def submit_fisher(model, task, prompts, samples, estimator, seed, max_new_tokens, temperature,
                      exact_output, _send=None):  # _send: the cost line instead (form_cost)
        return (_send or submit_and_show)("fisher", clean_spec(dict(
            model=model, task=task, prompts=prompts, samples=samples, estimator=estimator, seed=seed,
            max_new_tokens=max_new_tokens, temperature=temperature, exact_output=exact_output)))

    def submit_mask(fisher, select, density, model, seed):
        return submit_and_show("mask", clean_spec(dict(
            fisher=fisher, select=select, density=density, model=model, seed=seed)))

    def submit_train(model, task, algo, teacher, mask, mask_select, mask_density, optimizer, lr,
                     steps, batch, group, seed, precision=None, _send=None):
        if mask_select == "(none)":
            mask_select = None
        try:
            mask_density = opt_number(mask_density, "mask_density")
        except SpecError as exc:
            return errors_html(exc.errors), gr.skip(), gr.skip()
        return (_send or submit_and_show)("train", clean_spec(dict(
            model=model, task=task, algo=algo, teacher=teacher, mask=mask, mask_select=mask_select,
            mask_density=mask_density if mask_select else None, optimizer=optimizer, lr=lr,
            steps=steps, batch=batch, group=group, seed=seed, precision=precision)))

    def submit_sweep(model, algo, teacher, lrs, optimizers, precision, steps, seed, _send=None):
        try:
            lr_list = parse_float_list(lrs, "lrs")
        except SpecError as exc:
            return errors_html(exc.errors), gr.skip(), gr.skip()
        return (_send or submit_and_show)("sweep", clean_spec(dict(
            model=model, algo=algo, teacher=teacher, lrs=lr_list, optimizers=optimizers,
            precision=precision, steps=steps, seed=seed)))

    def submit_retention(model, algo, teacher, densities, selectors, seeds, steps, lr, _send=None):
        try:
            dens = parse_float_list(densities, "densities")
        except SpecError as exc:
            return errors_html(exc.errors), gr.skip(), gr.skip()
        return (_send or submit_and_show)("retention", clean_spec(dict(
            model=model, algo=algo, teacher=teacher, densities=dens, selectors=selectors,
            seeds=seeds, steps=steps, lr=lr)))

    def submit_diff(base, tuned, fisher, topk_percent):
        return submit_and_show("diff", clean_spec(dict(
            base=base, tuned=tuned, fisher=fisher, topk_percent=topk_percent)))

    def job_by_token(token: str) -> dict[str, Any] | None:
        """The job row of a share token (no result rows): what the progress poll needs."""
        from storage import repo

        with services.sessions(settings)() as s:
            job = repo.get_job_by_token(session=s, token=token)
            ok = job is not None and auth.can_read_result(settings, job)  # link off: owner only
            return repo.job_dict(job) if job is not None and ok else None

    def get_result(token: str) -> dict[str, Any] | None:
        return services.result_by_token(settings, token) if token else None

    def result_outputs(token: str, sig: str, readonly: bool, force: bool = False) -> list[Any]:
        """Updates for: progress, spec, share box, downloads, cancel, rerun, figs..., tables...,
        url, sig. gr.skip() everywhere when nothing changed since `sig`."""
        n_out = 7 + MAX_FIGS + MAX_TABLES + 3
        if not token:
            return [gr.skip()] * n_out
        meta = job_by_token(token)  # light: the job row only; the rows are read when drawing
        if meta is None:
            new_sig = f"{token}:missing"
            if new_sig == sig and not force:
                return [gr.skip()] * n_out
            return [not_found_html(token), "", "", gr.HTML(visible=False), gr.Button(visible=False),
                    gr.Button(visible=False), "",
                    *[gr.Plot(visible=False, value=None)] * MAX_FIGS,
                    *[gr.Dataframe(visible=False)] * MAX_TABLES, gr.skip(), new_sig, gr.skip()]
        status = meta["status"]
        final = status in FINAL_STATUSES
        new_sig = f"{token}:{status}:{meta.get('progress')}:{meta.get('message')}"
        if new_sig == sig and not force:
            return [gr.skip()] * n_out
        # figures, tables and downloads from the stored figures (app/figures/store.py: built once
        # per job, the same file the share page draws)
        stored = store_for(settings).get(meta["id"], meta.get("finished_at"),
                                         lambda: services.result_by_token(settings, token)
                                         ) if status == "succeeded" else None
        job = {"job": meta, "artifacts": (stored or {}).get("artifacts") or []}
        share = services.share_url(settings, token)
        path = f"/r/{token}" if readonly else "/?" + urlencode({"tab": "result", "r": token})
        head = [progress_html(meta), spec_html(meta), share,
                gr.HTML(value=downloads_html(job) if status == "succeeded" else "",
                        visible=status == "succeeded"),
                gr.Button(visible=not readonly and not final),
                gr.Button(visible=not readonly and final), gr.skip()]
        was_final_rendered = sig.startswith(f"{token}:") and sig.split(":")[1] in FINAL_STATUSES
        status_changed = not sig.startswith(f"{token}:{status}:")
        pick = refresh_result_choices(token) if status_changed and not readonly else gr.skip()
        if not final or (was_final_rendered and not force):
            # still running: progress only; figures stay hidden until the result is stored
            figs = [gr.Plot(visible=False, value=None)] * MAX_FIGS if not final else [gr.skip()] * MAX_FIGS
            tables = [gr.Dataframe(visible=False)] * MAX_TABLES if not final else [gr.skip()] * MAX_TABLES
            return [*head, *figs, *tables, path, new_sig, pick]
        figs_out: list[Any] = []
        figures = [(f["title"], PlotData(type="plotly", plot=json.dumps(f["figure"])))
                   for f in (stored or {}).get("figures") or []]
        for i in range(MAX_FIGS):
            if i < len(figures):
                title, fig = figures[i]
                figs_out.append(gr.Plot(value=fig, visible=True, label=title))
            else:
                figs_out.append(gr.Plot(visible=False, value=None))
        table_list = [(t["title"], (t["headers"], t["rows"])) for t in (stored or {}).get("tables") or []]
        tabs_out: list[Any] = []
        for i in range(MAX_TABLES):
            if i < len(table_list):
                title, (headers, rows) = table_list[i]
                tabs_out.append(gr.Dataframe(value=rows, headers=headers, label=title, visible=True))
            else:
                tabs_out.append(gr.Dataframe(visible=False))
        if status == "succeeded" and not figures and not table_list:
            head[0] += note_html("This result has no figures or tables.")
        return [*head, *figs_out, *tabs_out, path, new_sig, pick]

    def on_load(request: gr.Request):
        """Read the URL: /r/<token> arrives as ?view=<token> (read-only), ?r=, ?tab=, ?a=&b=."""
        q = dict(request.query_params) if request is not None else {}
        view = q.get("view", "")
        token = view or q.get("r", "")
        tab = "result" if token else q.get("tab", "new")
        tab = tab if tab in TABS else "new"
        readonly = bool(view)
        vis = [gr.Tab(visible=not readonly) for _ in TABS if _ != "result"]
        models = model_names()
        mdl = gr.Dropdown(choices=models, value=models[0][1] if models else None)
        return [
            gr.Tabs(selected=tab), token, readonly, gr.HTML(visible=readonly),
            gr.Row(visible=not readonly), *vis,
            q.get("a", ""), q.get("b", ""),
            mdl, mdl, mdl, mdl, mdl, mdl, mdl,
        ]

    def show_now(token, sig, readonly):
        return result_outputs(token, sig, readonly, force=True)

    def poll_result(token, sig, readonly):
        return result_outputs(token, sig, readonly)

    def refresh_result_choices(token):
        choices = job_choices()
        return gr.Dropdown(choices=choices, value=token if token in {c[1] for c in choices} else None)

    def pick_result(token):
        return token or ""

    def cancel_current(token):
        res = get_result(token)
        if res is None:
            return note_html("no job selected", "error")
        try:
            services.cancel(settings, res["job"]["id"])
        except LookupError as exc:
            return note_html(esc(exc), "error")
        return note_html(f"Cancel requested for job #{res['job']['id']}.")

    def reshare_current(token):
        """The owner's "new share link": a new token; the old link answers 404 from now on."""
        res = get_result(token)
        if res is None:
            return note_html("no job selected", "error"), gr.skip()
        try:
            job = services.set_sharing(settings, res["job"]["id"], "new")
        except (LookupError, ValueError) as exc:
            return note_html(esc(exc), "error"), gr.skip()
        return note_html("New share link: the old one no longer opens this result."), job["share_token"]

    def rerun_current(token):
        res = get_result(token)
        if res is None:
            return note_html("no job selected", "error"), gr.skip()
        try:
            job = services.rerun(settings, res["job"]["id"])
        except (LookupError, ValueError, RuntimeError) as exc:
            return note_html(esc(exc), "error"), gr.skip()
        return note_html(f"Re-running as job #{job['id']}."), job["share_token"]

    # jobs tab
    def jobs_view(kind, status, last, owner="me"):
        jobs = services.list_jobs(settings, limit=50, kind=kind or None, status=status or None,
                                  owner=owner or "me")  # my jobs; admins may pick all users
        out = jobs_table_html(jobs)
        return (gr.skip(), last) if out == last else (out, out)

    def who_am_i():
        """The signed-in user in the header; the owner filter for admins (app/auth.py)."""
        user = auth.current_user(settings)
        return (auth.user_header_html(settings),
                gr.Dropdown(visible=settings.auth_required and user.is_admin))

    def form_cost(submit_fn):
        """The cost line under a form, from the same form -> spec code as its submit button."""
        def run(*values):
            out = submit_fn(*values, _send=lambda kind, data: limits.form_estimate_html(settings, kind, data))
            return out if isinstance(out, str) else out[0]
        return run

    def job_action(action: str, job_id):
        if job_id is None:
            return note_html("Give a job id.", "error"), gr.skip(), gr.skip()
        if not float(job_id).is_integer():  # no rounding: 1.5 is not job 2
            return note_html(f"job id: got {job_id}; give a whole number", "error"), gr.skip(), gr.skip()
        job_id = int(job_id)
        try:
            if action == "cancel":
                job = services.cancel(settings, job_id)
                return note_html(f"Cancel requested for job #{job_id} (now {esc(job['status'])})."), gr.skip(), gr.skip()
            if action == "rerun":
                job = services.rerun(settings, job_id)
                return note_html(f"Re-running job #{job_id} as #{job['id']}."), gr.skip(), gr.skip()
            found = services.get_job(settings, job_id)
            if found is None:
                raise LookupError(f"job: no job with id {job_id}")
            return note_html(f"Showing job #{job_id}."), found["share_token"], gr.Tabs(selected="result")
        except (LookupError, ValueError, RuntimeError) as exc:
            return note_html(esc(exc), "error"), gr.skip(), gr.skip()

    # tokens tab
    def run_tokens(model, context, top_k, layer, random_k):
        try:
            layer = opt_number(layer, "layer", integer=True)
        except SpecError as exc:
            return errors_html(exc.errors), gr.skip(), ""
        data = clean_spec(dict(model=model, context=context, top_k=top_k, layer=layer, random_k=random_k))
        if isinstance(context, str) and context:
            data["context"] = context  # keep leading/trailing spaces: they are tokens
        job, msg = do_submit("tokens", data)
        if job is None:
            return msg, gr.skip(), ""
        return msg, job["share_token"], ""

    def poll_tokens(token, sig):
        """Updates for: progress, token radio, bars, similarity (top), similarity (random),
        trace F vs orthogonal sensitivities, sig."""
        n = 7
        meta = job_by_token(token) if token else None
        if meta is None:
            return [gr.skip()] * n
        new_sig = f"{token}:{meta['status']}:{meta.get('progress')}"
        if new_sig == sig:
            return [gr.skip()] * n
        res = get_result(token) if meta["status"] == "succeeded" else None
        if res is None:
            return [progress_html(meta), gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), new_sig]
        choices = plots.token_choices(res)
        names = [h.get("name", "") for h in res.get("heatmaps") or []]
        has_top = any("similarity" in n for n in names)
        has_random = any("similarity" in n and "random" in n for n in names)
        return [progress_html(meta) + downloads_html(res),
                gr.Radio(choices=choices, value=None, visible=bool(choices)),
                gr.Plot(value=plots.token_bars(res), visible=True),
                gr.Plot(value=plots.token_similarity_heatmap(res, "top"), visible=has_top),
                gr.Plot(value=plots.token_similarity_heatmap(res, "random"), visible=has_random),
                gr.Plot(value=plots.token_counterfactual_figure(res),
                        visible=bool((res.get("summary") or {}).get("similarity"))),
                new_sig]

    def extend_context(context, token):
        if token is None:
            return gr.skip()
        return (context or "") + str(token)

    # compare tab
    def compare(a, b):
        out: list[Any] = []
        sides = []
        for token in (a, b):
            res = get_result(token) if token else None
            figs = plots.result_figures(res) if res and res["job"]["status"] == "succeeded" else []
            sides.append((token, res, figs[:COMPARE_FIGS]))
        left, right = dict(sides[0][2]), dict(sides[1][2])
        for name in set(left) & set(right):  # same figure on both sides: one colour range
            plots.share_colour_range(left[name], right[name])
        for token, res, figs in sides:
            if res is None:
                head = not_found_html(token) if token else note_html("Pick a result.")
                out += [head, *[gr.Plot(visible=False, value=None)] * COMPARE_FIGS]
                continue
            head = spec_html(res["job"]) + (progress_html(res["job"]) if res["job"]["status"] != "succeeded" else "")
            slots = [gr.Plot(value=f, label=t, visible=True) for t, f in figs]
            slots += [gr.Plot(visible=False, value=None)] * (COMPARE_FIGS - len(slots))
            out += [head, *slots]
        url = "/?" + urlencode({"tab": "compare", "a": a or "", "b": b or ""})
        return [*out, url]

    def compare_choices(a, b):
        choices = job_choices(succeeded_only=True)
        return gr.Dropdown(choices=choices, value=a or None), gr.Dropdown(choices=choices, value=b or None)

    # models tab
    def models_table():
        rows = api.all_models(settings)
        headers = ["name", "source", "architecture", "n_params", "n_layers", "hidden_size", "vocab_size", "note",
                   "path"]
        return gr.Dataframe(value=[[r.get(h) for h in headers] for r in rows] or [[None] * len(headers)],
                            headers=headers)

    def register(path, name):
        try:
            m = api.register_local_model(settings, path or "", name)
        except SpecError as exc:
            return errors_html(exc.errors, "Not registered"), gr.skip()
        except PermissionError as exc:  # AUTH_REQUIRED: only admins register names
            return errors_html([{"field": "name", "message": str(exc)}], "Not registered"), gr.skip()
        return note_html(f"Registered <b>{esc(m['name'])}</b> ({esc(m['source'])})."), models_table()

    # ------------------------------------------------------------ layout

    fisher_defaults = SPECS["fisher"].model_fields
    with gr.Blocks(title="fisherlens", analytics_enabled=False) as demo:
        view_token = gr.State("")
        view_sig = gr.State("")
        readonly = gr.State(False)
        tok_token = gr.State("")
        tok_sig = gr.State("")
        jobs_last = gr.State("")
        url_box = gr.Textbox(visible="hidden", elem_id="fl-url")

        gr.HTML("<div class='fl-header'><a href='/' class='fl-logo'>fisherlens</a>"
                "<span class='fl-tagline'>why post-training updates so few parameters, through the "
                "diagonal Fisher</span><a class='fl-apidocs' href='/api/docs' target='_blank'>REST API</a></div>")
        user_box = gr.HTML(elem_id="fl-user")  # signed-in user + sign out (AUTH_REQUIRED only)
        shared_banner = gr.HTML(
            "<div class='fl-shared'>Shared result (read-only). <a href='/'>Open the fisherlens explorer</a></div>",
            visible=False)

        with gr.Tabs(selected="new", elem_id="fl-tabs") as tabs:
            with gr.Tab("New job", id="new", elem_id="tab-new") as tab_new:
                with gr.Tabs():
                    with gr.Tab("Fisher", id="f-fisher"):
                        with gr.Row():
                            f_model = gr.Dropdown(label="model", allow_custom_value=True, elem_id="fisher-model",
                                                  info="zoo name, registered local model, or org/name")
                            f_task = gr.Dropdown(TASKS, value="arithmetic", label="task", allow_custom_value=True)
                            f_est = gr.Dropdown(["sequence", "token", "empirical", "batch"], value="sequence",
                                                label="estimator")
                        with gr.Row():
                            f_prompts = gr.Number(8, label="prompts", step=1, elem_id="fisher-prompts",
                                                  info=_range_info("fisher", "prompts"))
                            f_samples = gr.Number(2, label="samples per prompt", step=1,
                                                  elem_id="fisher-samples", info=_range_info("fisher", "samples"))
                            f_seed = gr.Number(0, label="seed", step=1)
                            f_mnt = gr.Number(fisher_defaults["max_new_tokens"].default, label="max new tokens",
                                              step=1, info=_range_info("fisher", "max_new_tokens"))
                            f_temp = gr.Number(1.0, label="temperature", info=_range_info("fisher", "temperature"))
                            f_exact = gr.Checkbox(True, label="exact output-layer Fisher")
                        f_cost = gr.HTML(elem_id="fisher-cost")
                        f_btn = gr.Button("Compute Fisher", variant="primary", elem_id="fisher-submit")
                        f_msg = gr.HTML(elem_id="fisher-msg")
                    with gr.Tab("Mask", id="f-mask"):
                        with gr.Row():
                            m_fisher = gr.Dropdown(label="Fisher (a succeeded fisher job)", allow_custom_value=True,
                                                   choices=[("(none)", "")])
                            m_select = gr.Dropdown(SELECTORS, value="fisher", label="selector")
                            m_density = gr.Number(0.05, label="density", info=_range_info("mask", "density"))
                            m_model = gr.Dropdown(label="model (magnitude/gradient selectors)",
                                                  allow_custom_value=True)
                            m_seed = gr.Number(0, label="seed", step=1)
                        m_btn = gr.Button("Build mask", variant="primary")
                        m_msg = gr.HTML()
                    with gr.Tab("Train", id="f-train"):
                        with gr.Row():
                            t_model = gr.Dropdown(label="model", allow_custom_value=True, elem_id="train-model")
                            t_task = gr.Dropdown(TASKS, value="arithmetic", label="task", allow_custom_value=True)
                            t_algo = gr.Dropdown(["grpo", "opd", "sft"], value="grpo", label="algorithm")
                            t_teacher = gr.Dropdown(label="teacher (opd)", allow_custom_value=True,
                                                    elem_id="train-teacher")
                        with gr.Row():
                            t_mask = gr.Dropdown(label="mask (a succeeded mask job)", choices=[("(none)", "")],
                                                 allow_custom_value=True)
                            t_msel = gr.Dropdown(["(none)", *SELECTORS], value="(none)",
                                                 label="or build a mask with selector")
                            t_mden = gr.Textbox("", label="mask density", info=_range_info("train", "mask_density"))
                        with gr.Row():
                            t_opt = gr.Dropdown(["adamw", "sgd"], value="adamw", label="optimizer")
                            t_lr = gr.Number(_default("train", "lr"), label="learning rate", info=_range_info("train", "lr"))
                            t_steps = gr.Number(_default("train", "steps"), label="steps", step=1, info=_range_info("train", "steps"),
                                                elem_id="train-steps")
                            t_batch = gr.Number(_default("train", "batch"), label="prompts per step", step=1,
                                                elem_id="train-batch",
                                                info=_range_info("train", "batch"))
                            t_group = gr.Number(_default("train", "group"), label="GRPO group", step=1, info=_range_info("train", "group"),
                                                elem_id="train-group")
                            t_seed = gr.Number(0, label="seed", step=1)
                            t_prec = gr.Dropdown(["fp32", "bf16-mixed", "bf16"], value=_default("train", "precision"),
                                                 label="precision", info="bf16-mixed: fp32 master weights, "
                                                 "bf16 checkpoint; bf16: bf16 weights")
                        t_cost = gr.HTML(elem_id="train-cost")
                        t_btn = gr.Button("Train", variant="primary", elem_id="train-submit")
                        t_msg = gr.HTML()
                    with gr.Tab("Retention sweep", id="f-retention"):
                        with gr.Row():
                            r_model = gr.Dropdown(label="model", allow_custom_value=True)
                            r_algo = gr.Dropdown(["grpo", "opd", "sft"], value="grpo", label="algorithm")
                            r_teacher = gr.Dropdown(label="teacher (opd)", allow_custom_value=True)
                        with gr.Row():
                            r_dens = gr.Textbox("0.01,0.05,0.1", label="densities (comma separated)")
                            r_sel = gr.CheckboxGroup(SELECTORS, value=["fisher", "random", "magnitude"],
                                                     label="selectors")
                            r_seeds = gr.Number(_default("retention", "seeds"), label="seeds", step=1, info=_range_info("retention", "seeds"))
                            r_steps = gr.Number(_default("retention", "steps"), label="steps", step=1, info=_range_info("retention", "steps"))
                            r_lr = gr.Number(_default("retention", "lr"), label="learning rate", info=_range_info("retention", "lr"))
                        r_cost = gr.HTML(elem_id="retention-cost")
                        r_btn = gr.Button("Run retention sweep", variant="primary")
                        r_msg = gr.HTML()
                    with gr.Tab("LR x optimizer sweep", id="f-sweep"):
                        with gr.Row():
                            s_model = gr.Dropdown(label="model", allow_custom_value=True, elem_id="sweep-model")
                            s_algo = gr.Dropdown(["grpo", "opd", "sft"], value="grpo", label="algorithm")
                            s_teacher = gr.Dropdown(label="teacher (opd)", allow_custom_value=True)
                        with gr.Row():
                            s_lrs = gr.Textbox(",".join(f"{x:g}" for x in SPECS["sweep"].model_fields["lrs"]
                                                        .default_factory()),  # type: ignore[call-arg,misc]
                                               label="learning rates (comma separated)", elem_id="sweep-lrs")
                            s_opts = gr.CheckboxGroup(["adamw", "sgd"], value=["adamw", "sgd"], label="optimizers",
                                                      elem_id="sweep-optimizers")
                            s_prec = gr.CheckboxGroup(["fp32", "bf16-mixed", "bf16"], value=["bf16-mixed"],
                                                      label="precision")
                            s_steps = gr.Number(_default("sweep", "steps"), label="steps per point", step=1,
                                                info=_range_info("sweep", "steps"), elem_id="sweep-steps")
                            s_seed = gr.Number(0, label="seed", step=1)
                        s_cost = gr.HTML(elem_id="sweep-cost")
                        s_btn = gr.Button("Run sweep", variant="primary", elem_id="sweep-submit")
                        s_msg = gr.HTML()
                    with gr.Tab("Checkpoint diff", id="f-diff"):
                        with gr.Row():
                            d_base = gr.Dropdown(label="base", allow_custom_value=True, elem_id="diff-base")
                            d_tuned = gr.Dropdown(label="tuned (model, trained model or local folder)",
                                                  allow_custom_value=True, elem_id="diff-tuned")
                            d_fisher = gr.Dropdown(label="Fisher (optional)", choices=[("(none)", "")],
                                                   allow_custom_value=True)
                            d_topk = gr.Number(1.0, label="top-k %", info=_range_info("diff", "topk_percent"))
                        d_btn = gr.Button("Diff", variant="primary", elem_id="diff-submit")
                        d_msg = gr.HTML()

            with gr.Tab("Jobs", id="jobs", elem_id="tab-jobs") as tab_jobs:
                with gr.Row():
                    j_kind = gr.Dropdown([("all kinds", ""), *[(k, k) for k in SPECS]], value="", label="kind")
                    j_status = gr.Dropdown([("any status", ""), *[(s, s) for s in JOB_STATUSES]], value="",
                                           label="status")
                    j_owner = gr.Dropdown([("my jobs", "me"), ("all users", "all")], value="me",
                                          label="owner", visible=False, elem_id="jobs-owner")
                    j_id = gr.Number(None, label="job id", step=1)
                    with gr.Column(min_width=120):
                        j_open = gr.Button("Open", size="sm")
                        j_cancel = gr.Button("Cancel", size="sm", variant="stop")
                        j_rerun = gr.Button("Re-run", size="sm")
                j_msg = gr.HTML()
                j_table = gr.HTML(elem_id="fl-jobs", elem_classes=["fl-quiet"])

            with gr.Tab("Result", id="result", elem_id="tab-result"):
                with gr.Row(visible=True) as result_pick_row:
                    r_pick = gr.Dropdown(label="result", choices=[], allow_custom_value=True, scale=4,
                                         elem_id="result-pick", elem_classes=["fl-quiet"])
                    r_refresh = gr.Button("Refresh list", size="sm", scale=1)
                r_progress = gr.HTML(progress_html(None), elem_id="fl-progress", elem_classes=["fl-quiet"])
                r_spec = gr.HTML(elem_classes=["fl-quiet"])
                with gr.Row():
                    r_share = gr.Textbox(label="share link (anyone with it sees this result, read-only)",
                                         interactive=False, buttons=["copy"], elem_id="fl-share-url", scale=5,
                                         elem_classes=["fl-quiet"])
                    r_copy = gr.Button("Copy link", size="sm", elem_id="fl-copy", scale=1)
                    r_reshare = gr.Button("New link", size="sm", elem_id="fl-reshare", scale=1)
                    r_cancel = gr.Button("Cancel job", size="sm", variant="stop", visible=False, scale=1)
                    r_rerun = gr.Button("Re-run", size="sm", visible=False, scale=1)
                r_downloads = gr.HTML(visible=False, elem_classes=["fl-quiet"])
                r_note = gr.HTML()
                r_figs = [gr.Plot(visible=False, elem_classes=["fl-fig"], elem_id=f"fl-fig-{i}")
                          for i in range(MAX_FIGS)]
                r_tables = [gr.Dataframe(visible=False, interactive=False, elem_classes=["fl-table"])
                            for _ in range(MAX_TABLES)]

            with gr.Tab("Token explorer", id="tokens", elem_id="tab-tokens") as tab_tokens:
                gr.Markdown("Type a context: the worker computes the top next tokens, the similarity of "
                            "their parameter-sensitivity vectors, and each token's share of the Fisher "
                            "(random tokens for contrast). Click a token to extend the context.")
                with gr.Row():
                    k_model = gr.Dropdown(label="model", allow_custom_value=True, scale=2)
                    k_context = gr.Textbox("12+34=", label="context", scale=4, elem_id="tokens-context",
                                           info="accepted: 1 to 2000 characters")
                    k_topk = gr.Number(8, label="top k", step=1, info=_range_info("tokens", "top_k"))
                    k_layer = gr.Textbox("", label="layer (blank = whole model)", elem_id="tokens-layer")
                    k_random = gr.Number(8, label="random tokens", step=1, info=_range_info("tokens", "random_k"))
                k_btn = gr.Button("Explore", variant="primary", elem_id="tokens-submit")
                k_msg = gr.HTML()
                k_progress = gr.HTML(elem_id="tokens-progress", elem_classes=["fl-quiet"])
                k_choice = gr.Radio(label="next tokens: click one to extend the context", visible=False,
                                    elem_id="tokens-choice")
                k_bars = gr.Plot(visible=False, elem_id="tokens-bars", label="next tokens")
                with gr.Row():
                    k_sim_top = gr.Plot(visible=False, label="similarity (top tokens)")
                    k_sim_rand = gr.Plot(visible=False, label="similarity (random tokens)")
                k_counter = gr.Plot(visible=False, elem_id="tokens-counterfactual",
                                    label="trace F vs orthogonal sensitivities")

            with gr.Tab("Compare", id="compare", elem_id="tab-compare") as tab_compare:
                with gr.Row():
                    c_a = gr.Dropdown(label="left result", allow_custom_value=True)
                    c_b = gr.Dropdown(label="right result", allow_custom_value=True)
                    c_btn = gr.Button("Compare", variant="primary")
                with gr.Row():
                    with gr.Column():
                        c_head_a = gr.HTML()
                        c_figs_a = [gr.Plot(visible=False) for _ in range(COMPARE_FIGS)]
                    with gr.Column():
                        c_head_b = gr.HTML()
                        c_figs_b = [gr.Plot(visible=False) for _ in range(COMPARE_FIGS)]

            with gr.Tab("Models", id="models", elem_id="tab-models") as tab_models:
                m_table = gr.Dataframe(interactive=False, label="models")
                with gr.Row():
                    reg_path = gr.Textbox(label="register a local HF model folder",
                                          placeholder="/path/inside/the/allowed/roots", scale=4)
                    reg_name = gr.Textbox(label="name (optional)", scale=2)
                    reg_btn = gr.Button("Register", scale=1)
                reg_msg = gr.HTML()
                gr.Markdown("Local folders must be inside the zoo or the allowed model roots, which the "
                            "operator sets with `ALLOWED_MODEL_ROOTS=/a:/b`. Trained models need no "
                            "registering: every model field accepts `job:N` of a succeeded train job.")

        timer = gr.Timer(POLL_S)

        # ------------------------------------------------------------ wiring
        result_out = [r_progress, r_spec, r_share, r_downloads, r_cancel, r_rerun, r_note,
                      *r_figs, *r_tables, url_box, view_sig, r_pick]
        state_in = [view_token, view_sig, readonly]
        fast: dict[str, Any] = {"show_progress": "hidden", "concurrency_limit": None}

        url_box.change(None, inputs=url_box, js=URL_JS)
        demo.load(
            on_load, inputs=None,
            outputs=[tabs, view_token, readonly, shared_banner, result_pick_row,
                     tab_new, tab_jobs, tab_tokens, tab_compare, tab_models, c_a, c_b,
                     f_model, t_model, r_model, d_base, k_model, m_model, s_model],
            **fast,
        ).then(show_now, inputs=state_in, outputs=result_out, **fast).then(
            lambda a, b: [*compare_choices(a, b),
                          *(compare(a, b) if (a or b) else [gr.skip()] * (2 + 2 * COMPARE_FIGS + 1))],
            inputs=[c_a, c_b], outputs=[c_a, c_b, c_head_a, *c_figs_a, c_head_b, *c_figs_b, url_box], **fast,
        )
        view_token.change(show_now, inputs=state_in, outputs=result_out, **fast)
        r_pick.input(pick_result, inputs=r_pick, outputs=view_token, **fast)
        r_refresh.click(refresh_result_choices, inputs=view_token, outputs=r_pick, **fast)
        r_copy.click(None, inputs=r_share, js=COPY_JS)
        r_cancel.click(cancel_current, inputs=view_token, outputs=r_note)
        r_rerun.click(rerun_current, inputs=view_token, outputs=[r_note, view_token])
        r_reshare.click(reshare_current, inputs=view_token, outputs=[r_note, view_token])

        submit_out = lambda msg: [msg, view_token, tabs]  # noqa: E731
        f_btn.click(submit_fisher, inputs=[f_model, f_task, f_prompts, f_samples, f_est, f_seed, f_mnt,
                                           f_temp, f_exact], outputs=submit_out(f_msg))
        m_btn.click(submit_mask, inputs=[m_fisher, m_select, m_density, m_model, m_seed],
                    outputs=submit_out(m_msg))
        t_btn.click(submit_train, inputs=[t_model, t_task, t_algo, t_teacher, t_mask, t_msel, t_mden, t_opt,
                                          t_lr, t_steps, t_batch, t_group, t_seed, t_prec],
                    outputs=submit_out(t_msg))
        s_btn.click(submit_sweep, inputs=[s_model, s_algo, s_teacher, s_lrs, s_opts, s_prec, s_steps, s_seed],
                    outputs=submit_out(s_msg))
        r_btn.click(submit_retention, inputs=[r_model, r_algo, r_teacher, r_dens, r_sel, r_seeds, r_steps, r_lr],
                    outputs=submit_out(r_msg))
        d_btn.click(submit_diff, inputs=[d_base, d_tuned, d_fisher, d_topk], outputs=submit_out(d_msg))

        def refresh_refs():
            return (gr.Dropdown(choices=ref_choices("fisher")), gr.Dropdown(choices=ref_choices("mask")),
                    gr.Dropdown(choices=ref_choices("fisher")))

        tab_new.select(refresh_refs, outputs=[m_fisher, t_mask, d_fisher], **fast)
        model_boxes = [f_model, t_model, r_model, d_base, k_model, m_model, t_teacher, r_teacher, d_tuned]
        # the N_OPTIONAL_MODELS optional ones (t_teacher, r_teacher, d_tuned) come last
        tab_new.select(model_dropdowns, inputs=model_boxes, outputs=model_boxes, **fast)
        tab_tokens.select(model_dropdowns, inputs=model_boxes, outputs=model_boxes, **fast)
        demo.load(model_dropdowns, inputs=model_boxes, outputs=model_boxes, **fast)

        for comp in (j_kind, j_status, j_owner):
            comp.change(lambda k, s, o: jobs_view(k, s, "", o), inputs=[j_kind, j_status, j_owner],
                        outputs=[j_table, jobs_last], **fast)
        demo.load(who_am_i, outputs=[user_box, j_owner], **fast)
        cost_forms: list[tuple[Any, list[Any], Any]] = [
            (submit_fisher, [f_model, f_task, f_prompts, f_samples, f_est, f_seed, f_mnt, f_temp, f_exact], f_cost),
            (submit_train, [t_model, t_task, t_algo, t_teacher, t_mask, t_msel, t_mden, t_opt, t_lr, t_steps,
                            t_batch, t_group, t_seed, t_prec], t_cost),
            (submit_sweep, [s_model, s_algo, s_teacher, s_lrs, s_opts, s_prec, s_steps, s_seed], s_cost),
            (submit_retention, [r_model, r_algo, r_teacher, r_dens, r_sel, r_seeds, r_steps, r_lr], r_cost),
        ]
        for fn, ins, out in cost_forms:
            for widget in ins:  # the estimate is shown before submitting, and follows the form
                widget.change(form_cost(fn), inputs=ins, outputs=out, **fast)
        for btn, action in ((j_open, "open"), (j_cancel, "cancel"), (j_rerun, "rerun")):
            btn.click(lambda i, a=action: job_action(a, i), inputs=j_id, outputs=[j_msg, view_token, tabs])

        k_btn.click(run_tokens, inputs=[k_model, k_context, k_topk, k_layer, k_random],
                    outputs=[k_msg, tok_token, tok_sig])
        k_context.submit(run_tokens, inputs=[k_model, k_context, k_topk, k_layer, k_random],
                         outputs=[k_msg, tok_token, tok_sig])
        tok_poll_out = [k_progress, k_choice, k_bars, k_sim_top, k_sim_rand, k_counter, tok_sig]
        k_choice.input(extend_context, inputs=[k_context, k_choice], outputs=k_context).then(
            run_tokens, inputs=[k_model, k_context, k_topk, k_layer, k_random],
            outputs=[k_msg, tok_token, tok_sig])

        tab_compare.select(compare_choices, inputs=[c_a, c_b], outputs=[c_a, c_b], **fast)
        c_btn.click(compare, inputs=[c_a, c_b], outputs=[c_head_a, *c_figs_a, c_head_b, *c_figs_b, url_box])

        tab_models.select(models_table, outputs=m_table, **fast)

        # one poll per tick for the whole page (result progress, jobs table, token job)
        n_poll = len(result_out) + 2 + len(tok_poll_out)

        def poll_all(token, sig, ro, kind, status, last, ttoken, tsig, owner="me"):
            try:
                return [*poll_result(token, sig, ro), *jobs_view(kind, status, last, owner),
                        *poll_tokens(ttoken, tsig)]
            except Exception:  # noqa: BLE001 - e.g. a busy database: try again next tick, no modal
                log.warning("poll failed; retrying on the next tick", exc_info=True)
                return [gr.skip()] * n_poll

        timer.tick(poll_all, inputs=[*state_in, j_kind, j_status, jobs_last, tok_token, tok_sig, j_owner],
                   outputs=[*result_out, j_table, jobs_last, *tok_poll_out], **fast)
        reg_btn.click(register, inputs=[reg_path, reg_name], outputs=[reg_msg, m_table])
    return demo


def _default(kind: str, field: str) -> Any:
    """The spec's own default, so forms never drift from what the CLI and API use."""
    return SPECS[kind].model_fields[field].default


def _range_info(kind: str, field: str) -> str:
    """'1 to 4096' style hint from the spec's declared bounds."""
    info = SPECS[kind].model_fields[field]
    lo = hi = None
    lo_op = hi_op = ""
    for m in info.metadata:
        for attr, op in (("ge", ">="), ("gt", ">")):
            if getattr(m, attr, None) is not None:
                lo, lo_op = getattr(m, attr), op
        for attr, op in (("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None:
                hi, hi_op = getattr(m, attr), op
    parts = [f"{lo_op} {lo}" if lo is not None else "", f"{hi_op} {hi}" if hi is not None else ""]
    return "accepted: " + ", ".join(p for p in parts if p) if any(parts) else ""
