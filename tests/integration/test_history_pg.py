"""What an estimate reads of earlier jobs, on SQLite and PostgreSQL alike (JSON paths into the
stored spec and summary: storage.jobs.recent_completion_lengths, recent_timings): the latest
succeeded jobs that sampled the same model on the same task, newest first, and only the values
asked for."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg import pg_schema_url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fl.db'}"
    else:
        with pg_schema_url("fl_history") as url:
            yield url


def test_the_history_an_estimate_reads_is_the_same_on_both_databases(db_url: str) -> None:
    from storage import repo
    from storage.db import migrated_session_factory

    rec = {"max_new_tokens": 8, "rows": 4, "stopped": {"3": 4}, "open": 0}
    with migrated_session_factory(db_url)() as s:
        def job(kind: str, spec: dict, summary: dict | None, status: str = "succeeded",
                estimate: dict | None = None) -> int:
            j = repo.create_job(session=s, kind=kind, spec=spec, spec_hash=f"h{len(spec)}{kind}",
                                estimate=estimate)
            j.summary = summary
            s.commit()
            if status == "succeeded":
                repo.mark_succeeded(session=s, job_id=j.id)
            return j.id

        base = {"model": "arith-base", "task": "arithmetic", "temperature": 1.0}
        a = job("fisher", base, {"completion_lengths": rec, "seconds_parts": {"sampling": 0.5}},
                estimate={"model_seconds_parts": {"sampling": 1.0}})
        b = job("train", {**base, "temperature": 0.7}, {"completion_lengths": {**rec, "rows": 2}})
        job("train", base, {"completion_lengths": rec}, status="queued")  # not finished
        job("fisher", {**base, "model": "arith-teacher"}, {"completion_lengths": rec})  # another model
        job("fisher", {**base, "task": "arithmetic-add?digits=1"}, {"completion_lengths": rec})  # another task
        job("diff", {"base": "arith-base"}, {"changed_fraction": 0.1})  # samples nothing
        c = job("fisher", {**base, "estimator": "empirical"}, {"n_rows": 3})  # recorded none
        got = repo.recent_completion_lengths(session=s, model="arith-base", task="arithmetic")
        assert got == [(b, 0.7, {**rec, "rows": 2}), (a, 1.0, rec)], got
        assert repo.recent_completion_lengths(session=s, model="arith-base", task="arithmetic", limit=1) == [
            (b, 0.7, {**rec, "rows": 2})]
        timings = repo.recent_timings(session=s, kind="fisher")
        assert timings == [({**base}, {"model_seconds_parts": {"sampling": 1.0}}, {"sampling": 0.5})], timings
        assert c > a
