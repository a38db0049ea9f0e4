"""Account commands: `fisherlens user add|token|list|revoke|passwd|end-sessions|limits` (direct database
access: run them where the server's DATABASE_URL is reachable) and `fisherlens login|logout`
(save a server URL and token for the queue commands, file mode 0600)."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from app.commands.common import fail
from compute.contract.settings import get_settings


def _sessions() -> Any:
    from app import services

    return services.sessions(get_settings())


def _read_password(stdin: bool, prompt: bool) -> str | None:
    if stdin:
        pw = sys.stdin.readline().rstrip("\n")
    elif prompt:
        pw = click.prompt("password", hide_input=True, confirmation_prompt=True)
    else:
        return None
    if len(pw) < 8:
        fail(f"--password: got {len(pw)} characters; accepted: at least 8")
    if len(pw) > 1024:
        fail(f"--password: got {len(pw)} characters; accepted: at most 1024")
    return pw


def _show_token(secret: str) -> None:
    click.echo(f"API token (shown once, store it now): {secret}")
    click.echo("  use: export FISHERLENS_TOKEN=<token>, `fisherlens login`, or "
               "'Authorization: Bearer <token>'")


@click.group("user")
def user_group() -> None:
    """Manage accounts (for AUTH_REQUIRED=true servers)."""


@user_group.command("add")
@click.argument("name")
@click.option("--admin", is_flag=True, help="Admins see and manage every user's jobs.")
@click.option("--password", "prompt_pw", is_flag=True, help="Prompt for a password (browser sign-in).")
@click.option("--password-stdin", "stdin_pw", is_flag=True, help="Read the password from stdin.")
def add_cmd(name: str, admin: bool, prompt_pw: bool, stdin_pw: bool) -> None:
    """Create user NAME and print a new API token (once). Without a password the user signs in
    to the browser with NAME and that token."""
    from storage import users

    password = _read_password(stdin_pw, prompt_pw)
    with _sessions()() as s:
        try:
            user = users.create_user(session=s, name=name, password=password, is_admin=admin)
        except ValueError as exc:
            fail(str(exc))
        secret, _ = users.issue_token(session=s, user=user, label="created with the user")
    click.echo(f"user {user.name} created{' (admin)' if admin else ''}")
    _show_token(secret)


@user_group.command("token")
@click.argument("name")
@click.option("--label", default="", help="A note shown by `user list` (e.g. the machine).")
def token_cmd(name: str, label: str) -> None:
    """Issue another API token for NAME (printed once)."""
    from storage import users

    with _sessions()() as s:
        user = users.get_user(session=s, name=name)
        if user is None:
            fail(f"NAME: no user called {name!r}")
        secret, _ = users.issue_token(session=s, user=user, label=label)
    _show_token(secret)


@user_group.command("list")
def list_cmd() -> None:
    """Users, their limits, active jobs and live API tokens (id, prefix)."""
    from app.limits import job_ceiling
    from storage import users

    settings = get_settings()
    with _sessions()() as s:
        for u in users.list_users(session=s):
            active = users.active_jobs(session=s, owner_id=u.id)
            if u.name == users.LOCAL_USER and not u.password_hash and not users.list_tokens(session=s, user=u):
                # the embedded mode's owner: no password, no token, nobody can sign in as it
                click.echo(f"(embedded-mode owner '{u.name}': cannot sign in; {active} active jobs)")
                continue
            jobs_limit = u.max_active_jobs if u.max_active_jobs is not None else (
                settings.max_active_jobs_admin if u.is_admin else settings.max_active_jobs)
            cost, seconds = job_ceiling(settings, is_admin=u.is_admin, max_job_cost=u.max_job_cost,
                                        max_job_seconds=u.max_job_seconds)
            flags = ", ".join(f for f, on in (("admin", u.is_admin), ("disabled", u.disabled),
                                              ("password", bool(u.password_hash))) if on)
            click.echo(f"{u.name} [{flags or 'user'}]  active jobs {active}/"
                       f"{jobs_limit if jobs_limit is not None else 'no limit'}  cost ceiling "
                       f"{f'{cost:.3g}' if cost is not None else 'none'}"
                       + (f" ({seconds / 3600:.3g} h)" if seconds is not None else ""))
            for t in users.list_tokens(session=s, user=u):
                used = t.last_used_at.isoformat()[:19] if t.last_used_at else "never"
                click.echo(f"    token id {t.id}  {t.prefix}...  created "
                           f"{t.created_at.isoformat()[:19]}  last used {used}  {t.label}")


@user_group.command("revoke")
@click.argument("token_ref")
def revoke_cmd(token_ref: str) -> None:
    """Revoke an API token by its id or its first characters (>= 6; see `user list`), and
    end the browser sessions signed in with it."""
    from storage import users

    with _sessions()() as s:
        try:
            tok = users.revoke_token(session=s, ref=token_ref)
        except LookupError as exc:
            fail(str(exc))
        owner = users.get_user_by_id(session=s, user_id=tok.user_id)
    click.echo(f"token {tok.id} ({tok.prefix}...) of {owner.name if owner else '?'} revoked")


@user_group.command("passwd")
@click.argument("name")
@click.option("--password-stdin", "stdin_pw", is_flag=True, help="Read the password from stdin.")
def passwd_cmd(name: str, stdin_pw: bool) -> None:
    """Set NAME's password (for browser sign-in); every browser session of NAME ends."""
    from storage import users

    password = _read_password(stdin_pw, not stdin_pw)
    assert password is not None
    with _sessions()() as s:
        try:
            _, ended = users.set_password(session=s, name=name, password=password)
        except LookupError as exc:
            fail(str(exc))
    click.echo(f"password of {name} set; {ended} browser session(s) ended")


@user_group.command("end-sessions")
@click.argument("name")
def end_sessions_cmd(name: str) -> None:
    """End every browser session of NAME (they must sign in again); API tokens keep working
    (revoke those with `user revoke`)."""
    from storage import users

    with _sessions()() as s:
        try:
            ended = users.end_sessions(session=s, name=name)
        except LookupError as exc:
            fail(str(exc))
    click.echo(f"{ended} browser session(s) of {name} ended")


@user_group.command("limits")
@click.argument("name")
@click.option("--max-active-jobs", type=click.IntRange(1, 100_000), default=None,
              help="Queued + running jobs at once (default: the role's setting).")
@click.option("--max-job-cost", type=click.FloatRange(min=1.0), default=None,
              help="Per-job cost ceiling in parameter-token-passes (default: the role's setting).")
@click.option("--max-job-hours", type=click.FloatRange(min=0.001), default=None,
              help="Per-job limit on the estimated run time at the measured throughput "
              "(default: the role's MAX_JOB_SECONDS; --max-job-cost takes precedence).")
@click.option("--disable/--enable", default=None, help="A disabled user's tokens stop working.")
def limits_cmd(name: str, max_active_jobs: int | None, max_job_cost: float | None,
               max_job_hours: float | None, disable: bool | None) -> None:
    """Set NAME's own limits (omitted ones go back to the settings' defaults)."""
    from storage import users

    with _sessions()() as s:
        try:
            users.set_limits(session=s, name=name, max_active_jobs=max_active_jobs,
                             max_job_cost=max_job_cost,
                             max_job_seconds=max_job_hours * 3600 if max_job_hours else None)
            if disable is not None:
                users.set_disabled(session=s, name=name, disabled=disable)
        except LookupError as exc:
            fail(str(exc))
    click.echo(f"limits of {name}: active jobs {max_active_jobs or 'default'}, "
               f"cost ceiling {max_job_cost or 'default'}, run time {max_job_hours or 'default'} h"
               + ("" if disable is None else f", {'disabled' if disable else 'enabled'}"))


@click.command("login")
@click.option("--url", default=None, help="Server URL (default: FISHERLENS_URL, or PUBLIC_URL).")
@click.option("--token", "token_opt", default=None,
              help="API token (default: FISHERLENS_TOKEN, else a hidden prompt).")
def login_cmd(url: str | None, token_opt: str | None) -> None:
    """Check a token against a server and save both for the queue commands (mode 0600)."""
    from app import client

    url = (url or os.environ.get("FISHERLENS_URL") or get_settings().public_url).rstrip("/")
    token = token_opt or os.environ.get("FISHERLENS_TOKEN") or click.prompt(
        "API token", hide_input=True)
    try:
        status, payload = client.request("GET", url, token, "/api/me")
    except RuntimeError as exc:
        fail(str(exc), code=1)
    if status != 200:
        detail = payload.get("detail") if isinstance(payload, dict) else payload
        fail(f"{url} refused the token: {detail}", code=1)
    path = client.save_credentials(url, token, payload.get("name", ""))
    click.echo(f"signed in to {url} as {payload.get('name')}; saved to {path} (mode 0600)")


@click.command("logout")
def logout_cmd() -> None:
    """Forget the saved server URL and token."""
    from app import client

    path = client.credentials_path()
    if path.exists():
        path.unlink()
        click.echo(f"removed {path}")
    else:
        click.echo("no saved credentials")


commands: list[click.Command] = [user_group, login_cmd, logout_cmd]
