"""Control characters never reach the database (issue 28, item 5): one ASGI middleware, in front
of every route (the REST API, /login, the share pages, the Gradio endpoints), refuses a request
whose path, query parameters, form fields or JSON strings hold a control character.

PostgreSQL cannot store NUL in text (psycopg raises, which was a 500 with a traceback), and no
name, token, reference or spec value means anything with one. Refused:
- the path and every query parameter (name and value): any C0 control character (U+0000-U+001F)
  or DEL (U+007F);
- form fields (application/x-www-form-urlencoded) and every string (and key) of a JSON body:
  the same, except tab, newline and carriage return (a prompt or a context may hold them).
The answer is 422 in the API's bad-input shape (documented for every operation), naming where: {"detail": [{"field": "query.owner", "message": "control character
U+0000 is not accepted"}]}. Multipart bodies (uploads) pass as they are. It runs inside
auth.AccessGuard, so the body it reads is already bounded by MAX_BODY_BYTES.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qsl

STRICT = re.compile(r"[\x00-\x1f\x7f]")  # path and query: nothing of the kind
TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # bodies: tab, newline, CR allowed
_FORM = b"application/x-www-form-urlencoded"
_JSON = b"application/json"


def bad_char(value: str, pattern: re.Pattern[str] = STRICT) -> str | None:
    """'U+0000' for the first control character of `value`, else None."""
    m = pattern.search(value)
    return f"U+{ord(m.group()):04X}" if m else None


def first_bad_json(value: Any, where: str) -> tuple[str, str] | None:
    """(field path, 'U+....') of the first string or key of a parsed JSON value holding a
    control character, else None. Paths read like the API's fields: 'spec.model', 'data[0]'."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            ch = bad_char(v, TEXT)
            if ch:
                return at, ch
        elif isinstance(v, dict):
            for k, item in v.items():
                key = str(k)
                ch = bad_char(key, TEXT)
                if ch:
                    return f"{at}.{key!r}" if at else repr(key), ch
                stack.append((item, f"{at}.{key}" if at else key))
        elif isinstance(v, list):
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(v))
    return None


async def _answer(send: Any, status: int, field: str, ch: str) -> None:
    body = json.dumps({"detail": [{"field": field, "message": f"control character {ch} is not "
                                   "accepted"}]}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class InputHygiene:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        ch = bad_char(scope.get("path") or "")
        if ch:
            if scope["type"] == "http":
                await _answer(send, 422, "path", ch)
            return  # a websocket not accepted is closed by the server
        query = (scope.get("query_string") or b"").decode("latin-1")
        for k, v in parse_qsl(query, keep_blank_values=True, errors="replace"):
            ch = bad_char(k) or bad_char(v)
            if ch:
                if scope["type"] == "http":
                    await _answer(send, 422, f"query.{STRICT.sub('?', k)[:40]}", ch)
                return
        ctype = next((v for k, v in scope.get("headers") or [] if k == b"content-type"), b"")
        kind = ctype.split(b";", 1)[0].strip().lower()
        if scope["type"] != "http" or kind not in (_FORM, _JSON):
            await self.app(scope, receive, send)
            return
        messages, body = [], b""
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break  # the client left (or the body limit answered): the app hears it
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        bad = self._body_problem(kind, body)
        if bad:
            await _answer(send, 422, *bad)
            return
        replay = iter(messages)

        async def again() -> Any:
            return next(replay, None) or await receive()

        await self.app(scope, again, send)

    @staticmethod
    def _body_problem(kind: bytes, body: bytes) -> tuple[str, str] | None:
        text = body.decode("utf-8", errors="replace")
        if kind == _FORM:
            for k, v in parse_qsl(text, keep_blank_values=True, errors="replace"):
                ch = bad_char(k, TEXT) or bad_char(v, TEXT)
                if ch:
                    return f"form.{STRICT.sub('?', k)[:40]}", ch
            return None
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError:
            return None  # not JSON: the route answers 422 for that
        return first_bad_json(data, "")
