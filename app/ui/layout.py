"""The Gradio Blocks explorer: `build_ui(settings) -> gr.Blocks`.

Layout (one module per tab builds its components), then event wiring to the tabs' module-level
handlers (`page.bind` fixes their `settings` argument). No mutable module-level state (shared by
all users); per-user state lives in gr.State. No torch: jobs go through app.services (the worker
computes); finished results are drawn from their stored figures (app/figures/store.py).
The address bar follows what is shown (a hidden textbox whose change runs history.replaceState),
so it can always be copied: /r/<token> (read-only result), /?tab=..., /?tab=compare&a=..&b=...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from app.ui import compare, jobs, models, result, tokens
from app.ui.common import who_am_i
from app.ui.figs import PLOTLY_HEAD
from app.ui.formtab import Form, build_form, cost, form_defs, submit
from app.ui.page import (
    COPY_JS,
    URL_JS,
    bind,
    models_and_costs,
    on_load,
    poll_all,
    refresh_models,
    refresh_refs,
)

POLL_S = 1.5
HEADER = ("<div class='fl-header'><a href='/' class='fl-logo'>fisherlens</a>"
          "<span class='fl-tagline'>why post-training updates so few parameters, through the "
          "diagonal Fisher</span><a class='fl-apidocs' href='/api/docs' target='_blank'>REST API</a></div>")
FAST: dict[str, Any] = {"show_progress": "hidden", "concurrency_limit": None}


@dataclass
class Page:
    """Per-user state and the page-level components."""

    view_token: Any
    view_sig: Any
    readonly: Any
    tok_token: Any
    tok_sig: Any
    jobs_last: Any
    url_box: Any
    user_box: Any
    banner: Any
    tabs: Any
    others: list[Any]  # the tabs hidden on a read-only page: new, jobs, tokens, compare, models
    sub_token: Any = None  # the last job submitted from the forms, and its live line
    sub_sig: Any = None
    jobline: Any = None

    @property
    def tab_new(self) -> Any:
        return self.others[0]

    @property
    def tab_jobs(self) -> Any:
        return self.others[1]

    @property
    def tab_tokens(self) -> Any:
        return self.others[2]

    @property
    def tab_compare(self) -> Any:
        return self.others[3]

    @property
    def tab_models(self) -> Any:
        return self.others[4]


def build_ui(settings: Any) -> gr.Blocks:
    """The whole explorer for `settings` (a fisherlens Settings)."""
    with gr.Blocks(title="fisherlens", analytics_enabled=False) as demo:
        view_token, view_sig, readonly, tok_token, tok_sig, jobs_last = (
            gr.State(v) for v in ("", "", False, "", "", ""))
        url_box = gr.Textbox(visible="hidden", elem_id="fl-url")
        gr.HTML(HEADER, head=PLOTLY_HEAD)  # plotly.js loads with the page, before any result
        user_box = gr.HTML(elem_id="fl-user")  # signed-in user + sign out (AUTH_REQUIRED only)
        banner = gr.HTML("<div class='fl-shared'>Shared result (read-only). <a href='/'>Open the "
                         "fisherlens explorer</a></div>", visible=False)
        with gr.Tabs(selected="new", elem_id="fl-tabs") as tabs:
            with gr.Tab("New job", id="new", elem_id="tab-new") as tab_new:
                jobline = gr.HTML(elem_id="fl-submitted", elem_classes=["fl-quiet"])
                with gr.Tabs():
                    built = []
                    for d in form_defs():  # one sub-tab per registered kind with a form
                        with gr.Tab(d.title, id=f"f-{d.kind}"):
                            built.append(build_form(d))
            with gr.Tab("Jobs", id="jobs", elem_id="tab-jobs") as tab_jobs:
                jt = jobs.build()
            with gr.Tab("Result", id="result", elem_id="tab-result") as tab_result:
                rt = result.build()
            with gr.Tab("Token explorer", id="tokens", elem_id="tab-tokens") as tab_tokens:
                kt = tokens.build()
            with gr.Tab("Compare", id="compare", elem_id="tab-compare") as tab_compare:
                ct = compare.build()
            with gr.Tab("Models", id="models", elem_id="tab-models") as tab_models:
                mt = models.build()
        page = Page(view_token, view_sig, readonly, tok_token, tok_sig, jobs_last, url_box, user_box, banner, tabs,
                    [tab_new, tab_jobs, tab_tokens, tab_compare, tab_models], gr.State(""), gr.State(""), jobline)
        _wire_page(demo, settings, page, rt, ct, jt)
        _wire_forms(demo, settings, page, built, kt)
        _wire_tabs(settings, page, rt, jt, kt, ct, mt)
        # jobs submitted meanwhile (another tab, the CLI) appear in the picker
        tab_result.select(bind(result.result_choices, settings), inputs=view_token, outputs=rt.pick, **FAST)
    return demo


def _wire_page(demo: gr.Blocks, settings: Any, p: Page, rt: result.ResultTab, ct: compare.CompareTab,
               jt: jobs.JobsTab) -> None:
    """Load (everything the URL asks for in one event), the address bar, the per-tick poll."""
    result_out = result.outputs(rt, p.url_box, p.view_sig)
    state_in = [p.view_token, p.view_sig, p.readonly]
    p.url_box.change(None, inputs=p.url_box, js=URL_JS)
    demo.load(bind(on_load, settings), inputs=None,
              outputs=[p.tabs, p.view_token, p.readonly, p.banner, rt.pick_row, *p.others, ct.a, ct.b,
                       ct.k, *compare.outputs(ct, p.url_box)[:5], *result_out], **FAST)
    demo.load(bind(who_am_i, settings), outputs=[p.user_box, jt.owner], **FAST)
    # a new token (a submitted job, the picker, re-run, new link): drawn unless already shown
    p.view_token.change(bind(result.follow, settings), inputs=state_in, outputs=result_out, **FAST)


def _wire_forms(demo: gr.Blocks, settings: Any, p: Page, built: list[Form], kt: tokens.TokensTab) -> None:
    """Submit buttons, cost lines, model and job-reference dropdowns of the job forms."""
    for f in built:
        f.button.click(bind(submit, settings, f.d.kind, f.names), inputs=[*f.inputs, f.confirm],
                       outputs=[f.msg, p.view_token, p.tabs, p.sub_token, f.confirm])
        if f.cost is not None:
            # the estimate follows what the user changes: ONE listener for every field of the form,
            # so "always_last" holds across fields (the browser sends the next estimate only when
            # the pending one is back, with the values of then): a listener per field ran them in
            # parallel, and an earlier field's slower reply could overwrite a later one's line
            gr.on([w.input for w in f.inputs], bind(cost, settings, f.d.kind, f.names), inputs=f.inputs,
                  outputs=f.cost, trigger_mode="always_last", **FAST)
    costed = [f for f in built if f.cost is not None]
    model_boxes = [(c, opt) for f in built for c, opt in f.models] + [(kt.model, False)]
    roles = [f"{f.d.kind}.{f.names[f.inputs.index(c)]}" for f in built for c, _ in f.models] + ["tokens.model"]
    boxes = [c for c, _ in model_boxes]
    optional = [opt for _, opt in model_boxes]
    refresh = bind(refresh_models, settings, optional)
    cost_inputs = [c for f in costed for c in f.inputs]
    slots = [(pos, boxes.index(c)) for pos, c in enumerate(cost_inputs) if c in boxes]
    demo.load(bind(models_and_costs, settings, optional, [(f.d.kind, f.names) for f in costed], slots, roles),
              inputs=[*boxes, *cost_inputs], outputs=[*boxes, *[f.cost for f in costed if f.cost is not None]], **FAST)
    for tab in (p.tab_new, p.tab_tokens):  # a model trained meanwhile appears
        tab.select(refresh, inputs=boxes, outputs=boxes, **FAST)
    refs = [(c, kind) for f in built for c, kind in f.refs]
    fill_refs = bind(refresh_refs, settings, [k for _, k in refs])
    # the job-reference pickers (a Fisher for a mask, ...): filled on page load, when the New job
    # tab is shown, and after each submit
    demo.load(fill_refs, outputs=[c for c, _ in refs], **FAST)
    p.tab_new.select(fill_refs, outputs=[c for c, _ in refs], **FAST)
    for f in built:
        f.button.click(fill_refs, outputs=[c for c, _ in refs], **FAST)

    run = bind(tokens.run_tokens, settings)
    token_out = [kt.msg, p.tok_token, p.tok_sig]
    kt.button.click(run, inputs=kt.inputs, outputs=token_out)
    kt.context.submit(run, inputs=kt.inputs, outputs=token_out)
    kt.choice.input(tokens.extend_context, inputs=[kt.context, kt.choice], outputs=kt.context).then(
        run, inputs=kt.inputs, outputs=token_out)


def _wire_tabs(settings: Any, p: Page, rt: result.ResultTab, jt: jobs.JobsTab, kt: tokens.TokensTab,
               ct: compare.CompareTab, mt: models.ModelsTab) -> None:
    """The result tab's buttons, the jobs tab, compare, models, and the one poll per tick."""
    rt.pick.input(bind(result.pick_view, settings), inputs=[rt.pick, p.readonly],
                  outputs=[p.view_token, *result.outputs(rt, p.url_box, p.view_sig)], **FAST)
    rt.refresh.click(bind(result.result_choices, settings), inputs=p.view_token, outputs=rt.pick, **FAST)
    rt.copy.click(None, inputs=rt.share, js=COPY_JS)
    # the read-only view of a share link (p.readonly, server-side state) acts on nothing
    rt.cancel.click(bind(result.cancel_current, settings), inputs=[p.view_token, p.readonly], outputs=rt.note)
    rt.rerun.click(bind(result.rerun_current, settings), inputs=[p.view_token, p.readonly],
                   outputs=[rt.note, p.view_token])
    rt.reshare.click(bind(result.reshare_current, settings), inputs=[p.view_token, p.readonly],
                     outputs=[rt.note, p.view_token])

    for comp in (jt.kind, jt.status, jt.owner):
        comp.change(bind(jobs.jobs_filtered, settings), inputs=[jt.kind, jt.status, jt.owner],
                    outputs=[jt.table, p.jobs_last], **FAST)
    for btn, action in ((jt.open, "open"), (jt.cancel, "cancel"), (jt.rerun, "rerun")):
        btn.click(bind(jobs.job_action, settings, action), inputs=jt.job_id, outputs=[jt.msg, p.view_token, p.tabs])

    p.tab_jobs.select(bind(jobs.workers_view, settings), outputs=jt.workers, **FAST)
    jt.workers_refresh.click(bind(jobs.workers_view, settings), outputs=jt.workers, **FAST)

    ab = [ct.a, ct.b]
    p.tab_compare.select(bind(compare.compare_choices, settings), inputs=ab, outputs=ab, **FAST)
    ct.button.click(bind(compare.compare_view, settings), inputs=[*ab, ct.k], outputs=compare.outputs(ct, p.url_box))

    p.tab_models.select(bind(models.models_table, settings), outputs=mt.table, **FAST)
    mt.button.click(bind(models.register, settings), inputs=[mt.path, mt.name], outputs=[mt.msg, mt.table])

    poll_in = [p.view_token, p.view_sig, p.readonly, jt.kind, jt.status, p.jobs_last, p.tok_token, p.tok_sig,
               jt.owner, p.sub_token, p.sub_sig]
    gr.Timer(POLL_S).tick(bind(poll_all, settings), inputs=poll_in,
                          outputs=[*result.outputs(rt, p.url_box, p.view_sig), jt.table, p.jobs_last,
                                   *tokens.poll_outputs(kt, p.tok_sig), p.jobline, p.sub_sig], **FAST)
