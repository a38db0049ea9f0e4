"""The one result renderer (app/render.py) on a stored result of every kind.

Fixtures: tests/fixtures/results/<kind>.json are results as `GET /api/results/<token>` returned
them for the chain in tests/e2e/every_kind.py (fisher -> mask (fisher, 5%) -> masked GRPO in
bf16-mixed -> diff of arith-base vs that job, plus tokens, sweep and retention) run by a real
worker on the zoo (training series cut to 200 points per name). The slow test renders fresh runs
of the current runners too, so a summary shape added later is caught without new fixtures.

Checked on every kind: no table cell shows a Python/JSON dict or list, or markdown; every table
row has as many cells as headers; the key numbers come before the figures and the tables; every
figure's JSON parses; the share page and the explorer's result tab show the same rendered view.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from app import render
from app.figures.store import build_payload
from compute.jobs.registry import NAMES as KINDS
from tests.unit.test_result_contract import runs  # noqa: F401 - the fixture: one fresh run of every kind

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "results"
# What a raw Python or JSON structure, or a markdown table, looks like inside a cell.
RAW = re.compile(r"\{'|\{\"|\[\{|\['|': |\":|\|\s*-{3}|-{3}\s*\||\n")


class _Cells(HTMLParser):
    """Every table's headers and rows of cell texts, as a browser would show them."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[dict[str, Any]] = []
        self._cell: list[str] | None = None
        self._row: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append({"headers": [], "rows": []})
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "tr" and self._row is not None and self.tables:
            t = self.tables[-1]
            if t["headers"]:
                t["rows"].append(self._row)
            else:  # the first row: the <th> headers
                t["headers"] = self._row
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def tables_of(page: str) -> list[dict[str, Any]]:
    p = _Cells()
    p.feed(page)
    return p.tables


def stored(kind: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{kind}.json").read_text())


def check_view(kind: str, result: dict[str, Any]) -> str:
    payload = build_payload(result)
    page = render.result_html(payload)
    tables = tables_of(page)
    assert tables, f"{kind}: no table rendered"
    for t in tables:
        for row in t["rows"]:
            assert len(row) == len(t["headers"]), (kind, t["headers"], row)
            for text in row:
                assert not RAW.search(text), f"{kind}: raw structure or markdown in a cell: {text[:120]!r}"
                assert text not in ("None", "nan", "NaN"), f"{kind}: {text!r} in a cell"
    # key numbers first, then figures, then tables
    order = [page.index(s) for s in ("id='fl-key'", "id='fl-figures'", "id='fl-tables'") if s in page]
    assert order == sorted(order) and page.index("id='fl-key'") == order[0], kind
    figs = re.findall(r"<script type='application/json' id='fl-fig-\d+-data' class='fl-fig-data'>(.*?)</script>",
                      page, re.S)
    assert len(figs) == len(payload["figures"]) and all(json.loads(f)["data"] is not None for f in figs), kind
    return page


def test_fixtures_cover_every_kind():
    assert sorted(p.stem for p in FIXTURES.glob("*.json")) == sorted(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_every_stored_kind_renders_without_raw_dicts_or_markdown(kind):
    result = stored(kind)
    page = check_view(kind, result)
    # the nested summaries that once showed as Python dicts are dotted rows now
    if kind == "fisher":
        assert "exact_output.lm_head.weight" not in page  # a table of its own
        assert "Exact output-layer check" in page
    if kind in ("sweep", "retention"):
        assert "markdown" not in page  # the copy of the points table as text
    if kind == "train":
        # grouped: one card per nested mapping, labelled quantities, never a dotted key
        assert "bound.bound" not in page and "<div class='fl-table-title'>Bound</div>" in page
        assert ">Bound max ratio<" in page


def test_cells_are_people_text():
    assert render.plain({"a": 1, "b": [0.5, 2]}) == ("<span class='fl-kv'>a <b>1</b></span> "
                                                     "<span class='fl-kv'>b <b>0.5, 2</b></span>")
    assert render.number(108800.0) == "108,800" and render.number(0.000123) == "1.230e-04"
    assert render.number(3) == "3" and render.number(0.123456) == "0.1235"
    assert render.plain(None) == "" and render.plain(True) == "yes"
    assert "<td class='n'>1,234,567</td>" == render.cell(1234567)


def test_share_page_and_result_tab_render_the_same_view(tmp_path):
    """Both surfaces call app.render.result_html on the same stored payload: the share page
    shows every figure, the explorer the first MAX_FIGS, the rest is identical."""
    from app.share import result_page
    from app.ui import result as ui_result

    result = stored("diff")
    payload = build_payload(result)
    job = payload["job"]
    share = result_page({**job, "status": "succeeded"}, job["share_token"], payload)
    tab = ui_result.view_html(payload, job)
    assert render.result_html(payload) in share
    key = render.key_section(payload["numbers"])
    assert key in share and key in tab
    assert render.tables_html(payload["tables"]) in share and render.tables_html(payload["tables"]) in tab


def test_warnings_are_banners_and_notes_do_not_run_into_values():
    numbers = {"items": [{"label": "Gini coefficient", "value": "0.9416", "note": "0 = uniform, 1 = one coordinate"}],
               "warnings": ["bf16 weights compared exactly"], "verdict": {"level": "poor", "text": "poor"}}
    out = render.key_section(numbers)
    assert "<div class='fl-banner fl-warn' role='note'><b>Warning:</b> bf16 weights compared exactly</div>" in out
    assert "class='fl-banner fl-verdict fl-poor'" in out
    # value and note are separate blocks (the note's own line), never "0.94160 = uniform"
    assert "<span class='fl-val'>0.9416</span><span class='fl-cap'>0 = uniform" in out
    assert re.search(r"\.fl-val\{display:block", render.CSS) and re.search(r"\.fl-cap\{display:block", render.CSS)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fresh_runs_of_every_kind_render_cleanly(runs, kind):  # noqa: F811 - the imported fixture
    d = json.loads(json.dumps(runs[kind].to_dict(), default=str).replace("NaN", "null"))
    job = {"id": 1, "kind": kind, "status": "succeeded", "spec": {}, "share_token": "t", "finished_at": "x"}
    check_view(kind, {**d, "job": job, "kind": kind, "artifacts": []})

