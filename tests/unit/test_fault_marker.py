"""The fault-point marker is published atomically (compute.runtime.control.publish_once): a test
that sees FAULT_DIR/<point>.reached reads its whole text.

The race behind test_fanout_sweep's one-off AttributeError on a loaded machine (issue 30): the
marker used to be created with O_EXCL and written afterwards, so a test polling for it could
read "" in between and `re.search(r"job=(\\d+)", "")` was None. Here the worker is stopped at
the exact moment the marker's name appears (right after the link that publishes it) and the
test's read happens then: it must hold the job id."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from compute.runtime import control


def _enable(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    monkeypatch.setenv("FISHERLENS_TESTING", "1")
    monkeypatch.setenv("FISHERLENS_FAULT_POINTS", "mid_job")
    monkeypatch.setenv("FISHERLENS_FAULT_DIR", str(folder))


def test_marker_holds_its_text_the_moment_it_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _enable(monkeypatch, tmp_path)
    appeared, go_on = threading.Event(), threading.Event()
    real_link = os.link

    def link(src, dst) -> None:  # the worker stops right after the marker's name appears
        real_link(src, dst)
        appeared.set()
        assert go_on.wait(30)

    monkeypatch.setattr(os, "link", link)
    t = threading.Thread(target=control.fault_point, args=("mid_job", "job=42"), daemon=True)
    t.start()
    assert appeared.wait(30)
    marker = tmp_path / "mid_job.reached"
    text = marker.read_text()  # what the integration stack's wait_reached returns
    m = re.search(r"job=(\d+)", text)
    assert m is not None and m.group(1) == "42", repr(text)
    assert text == f"pid={os.getpid()} job=42\n"
    go_on.set()
    (tmp_path / "mid_job.release").touch()
    t.join(30)
    assert not t.is_alive()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid_job.reached", "mid_job.release"]  # no temp left
    # one-shot: a later arrival passes through and leaves the first marker as it was
    assert control.fault_point("mid_job", "job=43") is False
    assert marker.read_text() == text


def test_publish_once_is_exclusive(tmp_path: Path) -> None:
    p = tmp_path / "x.reached"
    assert control.publish_once(p, "first\n") is True
    assert control.publish_once(p, "second\n") is False
    assert p.read_text() == "first\n" and [q.name for q in tmp_path.iterdir()] == ["x.reached"]
