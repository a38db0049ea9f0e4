"""Where `fisherlens login` keeps the server URL and API token: `$FISHERLENS_CREDENTIALS`, else
`$XDG_CONFIG_HOME/fisherlens/credentials.json` (default `~/.config/...`), JSON {url, token, name},
mode 0600. Standard library only: the CLI (app/client.py) and a training process
(compute/integrations/server_mask.py, inside TRL) both read it without importing the app.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def credentials_path() -> Path:
    env = os.environ.get("FISHERLENS_CREDENTIALS")
    if env:
        return Path(env).expanduser()
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "fisherlens" / "credentials.json"


def load_credentials() -> dict[str, Any]:
    """The saved {url, token, name}; {} when there is none or it cannot be read."""
    path = credentials_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_credentials(url: str, token: str, name: str) -> Path:
    """Write {url, token, name} readable by this user only (0600, from creation on)."""
    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"url": url, "token": token, "name": name}, fh)
    os.chmod(path, 0o600)
    return path


def same_server(a: str | None, b: str | None) -> bool:
    """Whether two server URLs name the same server: scheme and host compared without case, the
    default port (80 / 443) filled in, a trailing slash ignored. Another host name for the same
    machine (localhost vs 127.0.0.1) is another server: a token goes where it was issued only."""
    from urllib.parse import urlsplit

    def key(url: str) -> tuple[str, str, int | None, str] | None:
        try:
            u = urlsplit(url.strip())
            port = u.port or {"http": 80, "https": 443}.get(u.scheme.lower())
        except ValueError:
            return None
        return u.scheme.lower(), (u.hostname or "").lower(), port, u.path.rstrip("/")

    if not a or not b:
        return False
    ka, kb = key(a), key(b)
    return ka is not None and ka == kb


def server_and_token(server: str | None = None, token: str | None = None) -> tuple[str | None, str | None]:
    """(server URL, token) to talk to: `server`, else FISHERLENS_URL, else the saved URL; `token`,
    else FISHERLENS_TOKEN, else the saved token, but the saved token only for the saved server
    (a token is never sent to a server it was not issued for). The one rule for the CLI's queue
    commands (app/client.py) and a training process (compute/integrations/server_mask.py)."""
    saved = load_credentials()
    saved_url = str(saved.get("url") or "").rstrip("/") or None
    url = (server or os.environ.get("FISHERLENS_URL") or saved_url or "").rstrip("/") or None
    tok = token or os.environ.get("FISHERLENS_TOKEN")
    if not tok and url is not None and same_server(url, saved_url) and saved.get("token"):
        tok = str(saved["token"])
    return url, tok


def login_hint(url: str | None, sent_token: bool) -> str:
    """What to do after a server refused a request (HTTP 401/403) to `url`: when the saved login
    is for another server (so its token was not sent), say so and name both."""
    saved = load_credentials()
    saved_url = str(saved.get("url") or "").rstrip("/") or None
    if not sent_token and saved.get("token") and saved_url and not same_server(url, saved_url):
        return (f"no token was sent: the token saved by `fisherlens login` is for {saved_url}, not "
                f"{url}, and goes only to that server; run `fisherlens login --url {url}` or set "
                "FISHERLENS_TOKEN")
    if sent_token:
        return "set FISHERLENS_TOKEN or run `fisherlens login` with a valid token"
    return f"no token was sent; run `fisherlens login --url {url}` or set FISHERLENS_TOKEN"
