"""The explorer's module-level handlers (app/ui/*) alone: forms generated from the spec metadata,
the result / compare / jobs handlers against a real SQLite database and figure store (job rows
moved through their states with storage's repository functions; no worker, no browser)."""

from __future__ import annotations

import inspect
import json
import re

import gradio as gr
import pytest

from app.ui import compare, forms, formtab, jobs, page, result, tokens
from app.ui.figs import figures_html, same_colour_range
from compute.contract.specs import SpecError
from compute.jobs.registry import KINDS, parse_spec
from tests.unit.test_share import _fisher_result, _job

SPECS = {name: kind.spec for name, kind in KINDS.items()}


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory):
    from app import services
    from compute.contract.settings import Settings

    s = Settings(fisherlens_home=tmp_path_factory.mktemp("ui_home"), database_url=None, redis_url=None,
                 public_url="http://testserver")
    services.sessions(s)  # migrated
    return s


def _figs(html_text: str) -> list[dict]:
    """The Plotly figures inside a rendered view, as the browser's JSON.parse sees them (the
    text of each figure's <script type='application/json'>)."""
    return [json.loads(m) for m in re.findall(r"<script type='application/json' id='[^']*' class='fl-fig-data'>(.*?)</script>",
                                               html_text, re.S)]


# ---------------------------------------------------------------- forms from the spec metadata


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_spec_field_gets_an_input_with_the_spec_default_and_range(kind):
    for name in forms.all_fields(kind):
        d = forms.describe(kind, name)
        info = SPECS[kind].model_fields[name]
        if not info.is_required() and info.default_factory is None:
            assert d.default == info.default, (kind, name)
        bounds = {k: getattr(m, k) for m in info.metadata for k in ("ge", "gt", "le", "lt")
                  if getattr(m, k, None) is not None}
        for op, v in bounds.items():  # the hint states every declared bound
            assert f"{dict(ge='>=', gt='>', le='<=', lt='<')[op]} {v}" in d.info, (kind, name, d.info)
        comp = forms.component(d)
        if d.widget in ("int", "float") and d.default is not None:
            assert isinstance(comp, gr.Number) and comp.precision is None  # never rounded
            assert comp.value == d.default
        elif d.widget in ("int", "float"):  # blank means "not given": text (a Number sends 0)
            assert isinstance(comp, gr.Textbox) and comp.value == ""
        elif d.widget == "choice":
            assert isinstance(comp, gr.Dropdown)
            values = [c[1] for c in comp.choices]
            assert set(values) >= set(d.choices) and ("" in values) == d.optional


def test_default_forms_submit_valid_specs_and_blank_advanced_fields_mean_the_default():
    for d in (formtab.FormDef("fisher", "", ("model", "prompts"), ""),):
        names = forms.all_fields(d.kind)
        values = [("arith-base" if n == "model" else None) for n in names]  # all blank
        data = forms.form_data(d.kind, names, values)
        assert data == {"model": "arith-base"}
        assert parse_spec("fisher", data) == parse_spec("fisher", {"model": "arith-base"})
    names = ["model", "lrs", "optimizers", "steps"]
    data = forms.form_data("sweep", names, ["arith-base", "1e-4, 1e-3", ["adamw"], 2.0])
    assert data == {"model": "arith-base", "lrs": [1e-4, 1e-3], "optimizers": ["adamw"], "steps": 2}
    with pytest.raises(SpecError) as err:
        forms.form_data("sweep", names, ["arith-base", "1e-4, x", [], None])
    assert err.value.errors[0]["field"] == "lrs"
    # blank-able number boxes: blank -> the default, text -> a number, else an error naming the field
    names = ["model", "mask_density", "fisher_prompts"]
    assert forms.form_data("train", names, ["m", " ", "64"]) == {"model": "m", "fisher_prompts": 64}
    with pytest.raises(SpecError) as err:
        forms.form_data("train", names, ["m", "a lot", ""])
    assert err.value.errors == [{"field": "mask_density", "message": "got 'a lot'; give a number or leave it blank"}]
    with pytest.raises(SpecError) as err:
        forms.form_data("train", names, ["m", "", "1.5"])
    assert err.value.errors[0]["field"] == "fisher_prompts"


def test_out_of_range_form_value_is_refused_naming_the_field_and_both_ends():
    data = forms.form_data("fisher", ["model", "prompts"], ["arith-base", 5000.0])
    with pytest.raises(SpecError) as err:
        parse_spec("fisher", data)
    assert err.value.errors == [{"field": "prompts", "message": "got 5000; accepted range: >= 1, <= 4096"}]
    assert forms.describe("fisher", "prompts").info.endswith("accepted: >= 1, <= 4096")


def test_page_load_sets_models_and_cost_lines_in_one_event(settings):
    """The cost lines are computed from the model each dropdown will show (here: no models in
    this home, so the line asks for one), never from older values than the form shows."""
    layout = [("fisher", ["model", "prompts"]), ("train", ["steps", "model"])]
    out = page.models_and_costs(settings, [False, True], layout, [(0, 0), (3, 0)], ["fisher.model", "train.teacher"],
                                "", "", None, 8.0, 2.0, None)
    assert len(out) == 2 + 2
    assert all("fix <b>model</b> first" in line for line in out[2:])
    out = page.models_and_costs(settings, [False], [("fisher", ["model", "prompts"])], [(0, 0)], ["fisher.model"],
                                "arith-base", None, 4.0)
    # computed for the chosen model (no zoo in this home: token-passes only, no parameter count)
    assert "data-within='yes'" in out[1] and "token-passes" in out[1]


def test_cost_line_names_the_field_to_fix_for_text_that_is_not_numbers(settings):
    out = formtab.cost(settings, "retention", ["model", "densities"], "arith-base", "0.1, many")
    assert "fix <b>densities</b> first" in out


# ---------------------------------------------------------------- result, compare, jobs


def test_result_view_draws_the_stored_figures_with_named_layers(settings):
    _, token = _job(settings, "succeeded", _fisher_result())
    out = result.result_view(settings, token, "", readonly=False, force=True)
    assert len(out) == result.N_OUT == len(result.outputs(result.ResultTab(*[None] * 11), None, None))
    assert "data-status='succeeded'" in out[0]
    # the key numbers come first, then the figures (as on the share page)
    view = out[result.VIEW]
    assert view.index("Key numbers") < view.index("fl-fig")
    figs = _figs(view)
    assert figs and "Fisher" in json.dumps(figs[0]["layout"]["title"])
    heat = next(f for f in figs if f["data"][0].get("type") == "heatmap")
    assert "embeddings" in heat["data"][0]["y"] and "-" not in heat["data"][0]["y"]
    assert out[6] == f"/?tab=result&r={token}"
    # the next poll with the same signature changes nothing
    again = result.result_view(settings, token, out[7], readonly=False)
    assert all(isinstance(v, type(gr.skip())) for v in again)
    # a read-only view (share link) has its own address
    assert result.result_view(settings, token, "", readonly=True, force=True)[6] == f"/r/{token}"


def test_result_view_of_a_running_job_and_of_an_unknown_token(settings):
    _, token = _job(settings, "running")
    out = result.result_view(settings, token, "", readonly=False, force=True)
    assert "data-status='running'" in out[0] and "fl-fig" not in out[result.VIEW]  # no figures before the result
    missing = result.result_view(settings, "no-such-token", "", readonly=False, force=True)
    assert "No result found" in missing[0] and missing[7] == "no-such-token:missing"


def test_compare_shows_stored_figures_with_layer_names_and_one_colour_range(settings):
    base = _fisher_result()
    _, a = _job(settings, "succeeded", base)
    other = _fisher_result()
    other.heatmaps[0].z[0][1] = 4.0  # the right side's q cell is 16x the left one's
    _, b = _job(settings, "succeeded", other)
    head_a, figs_a, head_b, figs_b, computed, url = compare.compare_view(settings, a, b)
    assert "Fisher result" in head_a and "Fisher result" in head_b and url == f"/?tab=compare&a={a}&b={b}&k=1"
    # results without stored tensors: no computed comparison, and the reason
    assert "No computed comparison" in computed and "stored no fisher tensors" in computed
    # each side leads with its key numbers, as the share page does
    assert "id='fl-key'" in head_a and "Fisher mass in the top 1% of coordinates" in head_b
    left, right = _figs(figs_a), _figs(figs_b)
    assert 0 < len(left) <= compare.COMPARE_FIGS
    for fig in left + right:
        for trace in fig["data"]:
            assert "-" not in (trace.get("y") or []), "a layer shown as '-'"
    hl = next(f for f in left if f["data"][0].get("type") == "heatmap")["data"][0]
    hr = next(f for f in right if f["data"][0].get("type") == "heatmap")["data"][0]
    assert (hl["zmin"], hl["zmax"]) == (hr["zmin"], hr["zmax"]) and hl["zauto"] is False
    # the stored payload itself is untouched (the colour range is per comparison)
    meta = result.job_by_token(settings, a)
    stored = result.stored_payload(settings, meta)
    assert all("zmin" not in t for f in stored["figures"] for t in f["figure"]["data"])
    empty = compare.compare_view(settings, "", "nope")
    assert "Pick a result" in empty[0] and "No result found" in empty[2] and empty[1] == ""


def test_same_colour_range_only_joins_single_heatmaps_of_the_same_name():
    def heat(z):
        return {"name": "h", "figure": {"data": [{"type": "heatmap", "z": z}]}}

    left, right = [heat([[1.0, None]]), {"name": "s", "figure": {"data": [{"type": "scatter"}]}}], [heat([[3.0]])]
    same_colour_range(left, right)
    assert left[0]["figure"]["data"][0]["zmin"] == 1.0 and right[0]["figure"]["data"][0]["zmax"] == 3.0
    assert "zmin" not in left[1]["figure"]["data"][0]


def test_figures_html_round_trips_the_plotly_json_and_escapes_it():
    fig = {"data": [{"type": "bar", "x": ["<b>'q'</b>", 'say "hi"'], "y": [1, 2]}], "layout": {"title": "t"}}
    out = figures_html([{"name": "n", "title": "t", "figure": fig}], "fl-fig")
    assert "<b>'q'" not in out and "id='fl-fig-0'" in out
    assert _figs(out) == [fig]


def test_jobs_handlers_validate_ids_and_list_jobs(settings):
    assert "Give a job id" in jobs.job_action(settings, "open", None)[0]
    assert "give a whole number" in jobs.job_action(settings, "cancel", 1.5)[0]
    assert "no job with id 99999" in jobs.job_action(settings, "open", 99999)[0]
    job_id, token = _job(settings, "queued")
    msg, view, _ = jobs.job_action(settings, "open", float(job_id))
    assert f"Showing job #{job_id}" in msg and view == token
    table, last = jobs.jobs_filtered(settings, "", "queued")
    assert f"data-job='{job_id}'" in table and last == table
    assert isinstance(jobs.jobs_view(settings, "", "queued", last)[0], type(gr.skip()))


def test_tokens_handlers(settings):
    assert tokens.extend_context("12+", "3") == "12+3"
    msg, _, _ = tokens.run_tokens(settings, "arith-base", "   ", 8, None, 8)
    assert "context" in msg and "nothing was queued" in msg


def test_bind_keeps_the_signature_so_gradio_still_injects_the_request():
    bound = page.bind(page.on_load, object())
    assert list(inspect.signature(bound).parameters) == ["request"]
    from gradio.utils import get_type_hints

    assert get_type_hints(bound)["request"] is gr.Request
