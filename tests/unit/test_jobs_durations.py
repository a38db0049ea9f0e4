"""The Jobs tab's duration column: how long a finished job took, how long a running one has run
and the time it has left at its average pace, how long a queued one has waited."""

from __future__ import annotations

from datetime import UTC, datetime

from app.ui.snippets import duration_html, jobs_table_html, span_text

NOW = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)


def test_durations_and_eta():
    done = {"status": "succeeded", "started_at": "2026-12-03T11:00:00", "finished_at": "2026-12-03T11:03:05"}
    assert duration_html(done, NOW) == "3 min 5 s"
    running = {"status": "running", "started_at": "2026-12-03T11:59:00+00:00", "progress": 0.25}
    assert duration_html(running, NOW) == "60 s so far, about 3 min 0 s left"  # 60 s x 0.75 / 0.25
    early = {**running, "progress": 0.01}
    assert duration_html(early, NOW) == "60 s so far"  # too early to extrapolate
    assert duration_html({"status": "queued", "created_at": "2026-12-03T11:59:50"}, NOW) == "waiting 10 s"
    assert span_text(7300) == "2 h 1 min" and span_text(-3) == "0 s"


def test_jobs_table_has_a_duration_column():
    job = {"id": 3, "kind": "fisher", "status": "succeeded", "spec": {"model": "arith-base"}, "share_token": "t",
           "started_at": "2026-12-03T11:00:00", "finished_at": "2026-12-03T11:00:42", "created_at": "2026-12-03T10:59:00"}
    html = jobs_table_html([job])
    assert "<th>duration</th>" in html and "<td class='fl-duration'>42 s</td>" in html


def test_token_explorer_shows_the_share_link(tmp_path):
    import json
    from pathlib import Path

    from app.ui import tokens
    from compute.contract.jobresult import Heatmap, JobResult, LayerStat
    from compute.contract.settings import Settings
    from tests.unit.test_share import _job

    settings = Settings(fisherlens_home=tmp_path, database_url=None, redis_url=None, public_url="http://fl.example")
    raw = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "results" / "tokens.json").read_text())
    result = JobResult(kind="tokens", summary=raw["summary"],
                       layer_stats=[LayerStat(**r) for r in raw.get("layer_stats") or []],
                       heatmaps=[Heatmap(**h) for h in raw.get("heatmaps") or []])
    _, token = _job(settings, "succeeded", result, kind="tokens", spec={"model": "arith-base", "context": "1+1="})
    progress, *_ = tokens.poll_tokens(settings, token, "")
    assert f"<a href='http://fl.example/r/{token}' target='_blank'>" in progress and "Share this result" in progress
