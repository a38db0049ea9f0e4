"""Typed summary tables: labelled quantities with units, one card per group, no dotted keys, the
run's settings folded away in their own table."""

from __future__ import annotations

from app import render
from app.figures import tables


def test_quantity_labels_carry_units_and_words():
    assert tables.quantity_label("dense_bytes_total") == "Dense total (bytes)"
    assert tables.quantity_label("mean_step_auc") == "Mean step AUC"
    assert tables.quantity_label("support_percent") == "Support (%)"
    assert tables.quantity_label("seconds_wall") == "Wall (s)"
    assert tables.quantity_label("max_abs_delta") == "Max absolute delta"


def test_summary_is_grouped_and_settings_are_folded():
    summary = {"base_reward": 0.2, "bound": {"max_ratio": 1.3, "inner": {"a_b": 1}},
               "settings": {"lr": 0.001}, "conventions": {"x": "y"}}
    rows = tables._group_rows(summary, settings=False)
    assert rows == [["", "Base reward", 0.2], ["Bound", "Max ratio", 1.3], ["Bound", "Inner / A b", 1]]
    assert not [r for r in rows if "." in str(r[1])]  # never a dotted key
    assert tables._group_rows(summary, settings=True) == [["Settings", "Learning rate", 0.001],
                                                           ["Conventions", "X", "y"]]
    html = render.tables_html([{"title": "Summary", "headers": tables.GROUP_HEADERS, "rows": rows},
                               {"title": tables.SETTINGS_TITLE, "headers": tables.GROUP_HEADERS,
                                "rows": tables._group_rows(summary, settings=True)}])
    assert html.count("class='fl-table'") == 4  # Summary, Bound, Settings, Conventions
    assert "<div class='fl-table-title'>Bound</div>" in html
    assert "<details class='fl-run-settings'><summary>Settings of this run</summary>" in html
    assert html.index("fl-run-settings") < html.index("Learning rate")
