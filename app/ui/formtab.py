"""One job form, generated from its spec (app/ui/forms.py): the fields a tab names first, every
other spec field under "More settings" (blank = the spec default), a cost line, a submit button.
Which fields come first, the tab's label and the button are the kind's `form`
(compute/jobs/<kind>.py); `form_defs()` lists every kind that has one, in the registry's order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from app import limits
from app.ceiling import duration
from app.ui import forms
from app.ui.common import MODEL_FIELDS, NONE_CHOICE, TASKS, submit_and_show
from app.ui.snippets import errors_html, esc, note_html
from compute.contract.specs import SpecError
from compute.jobs import registry

ROW = 5  # inputs per row


@dataclass(frozen=True)
class FormDef:
    """What a job form shows first; everything else comes from the spec."""

    kind: str
    title: str  # the sub-tab's title
    main: tuple[str, ...]  # shown first, in this order
    button: str
    cost: bool = True  # show the cost estimate line
    values: dict[str, Any] = field(default_factory=dict)  # starting values other than the default


def form_defs() -> list[FormDef]:
    """The New job forms: every registered kind with a `form`, in the registry's order."""
    return [FormDef(k.name, k.form.tab, tuple(k.form.main), k.form.button, k.form.cost, dict(k.form.values))
            for k in registry.KINDS.values() if k.form is not None]


RUN_DIR_LABEL = "run folder (run_dir)"
RUN_DIR_PLACEHOLDER = "/data/runs/grpo-qwen (holds checkpoint-1, checkpoint-2, ...) or job:12"
RUN_DIR_INFO = ("a folder on the server holding checkpoint-<step> subfolders: a TRL / HF Trainer "
                "output_dir saved with save_steps, or `fisherlens train --save-steps`; or job:<id> of "
                "such a train job. It must be inside the allowed model roots (ALLOWED_MODEL_ROOTS)")


def ref_kind(kind: str, name: str) -> str | None:
    """The job kind a job-reference dropdown of field `name` lists (the first kind providing its
    target: a Fisher for `fisher`, a mask for `mask`), or None when `name` is not such a field.
    A run folder (`run_dir`) is a text box (a path on the server), never a dropdown."""
    target = registry.get(kind).refs.get(name)
    if target == "run_dir":
        return None
    providers = registry.producers(target) if target not in (None, "model") else ()  # type: ignore[arg-type]
    return providers[0] if providers else None


@dataclass
class Form:
    """The components of a built form; `inputs[i]` holds spec field `names[i]`."""

    d: FormDef
    names: list[str]
    inputs: list[Any]
    button: Any
    msg: Any
    confirm: Any  # the checkbox of a job above CONFIRM_ABOVE_S (shown when the submit asks)
    cost: Any | None
    models: list[tuple[Any, bool]]  # model dropdowns, optional?
    refs: list[tuple[Any, str]]  # reference dropdowns, the job kind they list


def field_input(kind: str, name: str, *, blank: bool = False, value: Any = None) -> Any:
    """The input of one spec field: model and job-reference fields are dropdowns filled later
    (the models and jobs change), the task a dropdown of the built-in tasks, the rest from the
    spec metadata."""
    d = forms.describe(kind, name)
    eid = f"{kind}-{name.replace('_', '-')}"
    if name in MODEL_FIELDS:  # wide enough for 'smollm2-135m (dequantised from Q4_1)' uncut
        return gr.Dropdown(label=d.label, info=d.help, allow_custom_value=True, elem_id=eid,
                           choices=[NONE_CHOICE] if d.optional else [], scale=2, min_width=340)
    if registry.get(kind).refs.get(name) == "run_dir":  # a folder path first, job:N also works
        return gr.Textbox(label=RUN_DIR_LABEL, info=RUN_DIR_INFO, placeholder=RUN_DIR_PLACEHOLDER,
                          elem_id=eid, scale=3, min_width=420)
    listed = ref_kind(kind, name)
    if listed is not None and d.widget == "text":
        return gr.Dropdown(label=f"{d.label} (a succeeded {listed} job)", info=d.help,
                           choices=[NONE_CHOICE], value="", allow_custom_value=True, elem_id=eid)
    if name == "task":
        return gr.Dropdown(TASKS, value=None if blank else d.default, label=d.label, info=d.help,
                           allow_custom_value=True, elem_id=eid)
    return forms.component(d, blank=blank, value=value)


def build_form(d: FormDef) -> Form:
    """The form inside the current gr.Tab context."""
    comps: dict[str, Any] = {}
    for i in range(0, len(d.main), ROW):
        with gr.Row():
            for name in d.main[i:i + ROW]:
                comps[name] = field_input(d.kind, name, value=d.values.get(name))
    rest = [n for n in forms.all_fields(d.kind) if n not in d.main]
    if rest:
        with gr.Accordion("More settings (blank = the spec default)", open=False):
            for i in range(0, len(rest), ROW):
                with gr.Row():
                    for name in rest[i:i + ROW]:
                        comps[name] = field_input(d.kind, name, blank=True)
    cost = gr.HTML(elem_id=f"{d.kind}-cost") if d.cost else None
    confirm = gr.Checkbox(False, visible=False, elem_id=f"{d.kind}-confirm", interactive=True,
                          label="I understand this job takes long")
    button = gr.Button(d.button, variant="primary", elem_id=f"{d.kind}-submit")
    msg = gr.HTML(elem_id=f"{d.kind}-msg")
    names = list(comps)
    models = [(comps[n], forms.describe(d.kind, n).optional) for n in names if n in MODEL_FIELDS]
    refs = [(comps[n], listed) for n in names
            if (listed := ref_kind(d.kind, n)) is not None and forms.describe(d.kind, n).widget == "text"]
    return Form(d, names, [comps[n] for n in names], button, msg, confirm, cost, models, refs)


# ---------------------------------------------------------------- handlers


def submit(settings: Any, kind: str, names: list[str], *values: Any) -> tuple[Any, ...]:
    """Updates for (message, view token, tabs, submitted token, confirmation checkbox) after the
    submit button; `values` are the form's inputs and, last, the confirmation checkbox. A job
    estimated above CONFIRM_ABOVE_S is not queued until the box ("I understand this takes about
    3.2 h") is ticked and the button clicked again."""
    *fields, confirmed = values
    try:
        data = forms.form_data(kind, names, fields)
    except SpecError as exc:
        return errors_html(exc.errors), gr.skip(), gr.skip(), gr.skip(), gr.skip()
    try:
        out = submit_and_show(settings, kind, data, confirm=bool(confirmed))
    except limits.ConfirmationRequired as exc:
        took = duration(float(exc.errors[0]["seconds"]))
        text = (f"This job takes about {took} (estimated), above the confirmation threshold of "
                f"{duration(float(exc.errors[0]['limit']))}. Tick \"I understand\" and click again "
                "to queue it.")
        return (note_html(esc(text), "warn"), gr.skip(), gr.skip(), gr.skip(),
                gr.Checkbox(value=False, visible=True, label=f"I understand this takes about {took}"))
    return (*out, gr.Checkbox(value=False, visible=False))


def cost(settings: Any, kind: str, names: list[str], *values: Any) -> str:
    """The cost line under a form, from the same form -> spec code as its submit button."""
    try:
        data = forms.form_data(kind, names, values)
    except SpecError as exc:  # text that is not a number list: the line says which field to fix
        return (f"<div class='fl-cost' data-within='unknown'>estimated cost: fix "
                f"<b>{esc(exc.errors[0]['field'])}</b> first</div>")
    return limits.form_estimate_html(settings, kind, data)


def costs(settings: Any, layout: list[tuple[str, list[str]]], *values: Any) -> list[str]:
    """The cost lines of several forms at once (one event on page load): `layout` is each form's
    (kind, field names), `values` all their inputs in that order."""
    out, i = [], 0
    for kind, names in layout:
        out.append(cost(settings, kind, names, *values[i:i + len(names)]))
        i += len(names)
    return out
