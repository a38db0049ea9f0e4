"""The HTTP client raises typed errors and never exits the process; the CLI alone turns them into
one line and an exit status."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from app import client
from app.cli import main


def test_refused_credential_is_an_exception_not_an_exit() -> None:
    with pytest.raises(client.Refused, match="refused: bad token") as info:
        client._raise_for(401, {"detail": "bad token"}, server=("http://127.0.0.1:9", "t"))
    assert info.value.code == 1
    with pytest.raises(client.Refused):
        client._raise_for(403, {"detail": "cross-site"})
    with pytest.raises(LookupError):
        client._raise_for(404, {"detail": "job: no job with id 7"})


def test_no_reuse_through_a_server_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "remote", lambda: ("http://127.0.0.1:9", "tok"))
    with pytest.raises(client.NotRemote) as info:
        client.submit(None, "fisher", {"model": "arith-base"}, reuse=False)
    assert info.value.code == 2


def test_cli_reports_a_client_error_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "remote", lambda: ("http://127.0.0.1:9", "tok"))
    res = CliRunner().invoke(main, ["submit", "fisher", "--no-reuse", "--spec", '{"model": "arith-base"}'])
    assert res.exit_code == 2
    assert "error: --no-reuse: not available through the server's API" in res.output
    assert "Traceback" not in res.output
