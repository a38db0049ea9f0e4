"""Task names: what `compute.lm.verifiable_tasks.get_task` accepts, parsed and checked without
building the task (no file is read, nothing is generated). The spec validators (specs.py) and
get_task both call `parse_task_name`, so a name the web process accepts is one a worker can build.

Accepted names (the meaning of each is in compute.lm.verifiable_tasks):
- ``arithmetic``, ``arithmetic-add``, ``arithmetic-mul``, with options after ``?``: ``digits``
  and ``mul_digits`` (1..6), and for ``arithmetic`` ``mul_share`` (0..1);
- ``jsonl:PATH``, option ``match`` (``exact`` or ``numeric``).

Errors are ValueError("task: ...") or, for an option out of range, ValueError("<option>: ...").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import parse_qsl

TASK_NAMES = ("arithmetic", "arithmetic-add", "arithmetic-mul", "jsonl:PATH")
ARITHMETIC_OPS: dict[str, tuple[str, ...]] = {
    "arithmetic": ("+", "*"), "arithmetic-add": ("+",), "arithmetic-mul": ("*",),
}
MATCHES = ("exact", "numeric")


@dataclass(frozen=True)
class ArithmeticName:
    """A parsed arithmetic task name: its operations and options (defaults filled in)."""

    name: str
    ops: tuple[str, ...]
    digits: int = 2
    mul_digits: int = 1
    mul_share: float = 0.25


@dataclass(frozen=True)
class JsonlName:
    """A parsed ``jsonl:PATH?match=...`` task name (the file itself is not opened here)."""

    name: str
    path: str
    match: str = "exact"


def prompt_tokens(name: str, default: int) -> int:
    """Tokens of one prompt of the task, for the cost model (compute.contract.cost.Sizing): an
    arithmetic prompt ``"12+34="`` is at most its characters (every operand digit, the operation
    and ``=``: a byte-level or digit-splitting tokenizer makes at most one token of each) plus one
    special token; a jsonl file is not opened here (the web process estimates, and a path is the
    user's): it counts as `default` tokens. An unknown name counts as `default` too."""
    try:
        parsed = parse_task_name(name)
    except ValueError:
        return default
    if isinstance(parsed, JsonlName):
        return default
    second = max(parsed.digits if "+" in parsed.ops else 0, parsed.mul_digits if "*" in parsed.ops else 0)
    return parsed.digits + 1 + second + 1 + 1


def unknown_task(name: str) -> ValueError:
    return ValueError(f"task: unknown task {name!r}; accepted: {', '.join(TASK_NAMES)}")


def check_match(match: str) -> None:
    if match not in MATCHES:
        raise ValueError(f"task: match={match!r} is not accepted; accepted: exact, numeric")


def check_arithmetic(ops: tuple[str, ...], digits: int, mul_digits: int, mul_share: float) -> None:
    """The ranges of an arithmetic task's settings (ValueError naming the setting)."""
    if not ops or any(op not in ("+", "*") for op in ops):
        raise ValueError(f"ops: {ops!r} is not accepted; accepted: '+', '*'")
    if not 0.0 <= mul_share <= 1.0:
        raise ValueError(f"mul_share: {mul_share} is out of range; accepted: 0..1")
    for field, value in (("digits", digits), ("mul_digits", mul_digits)):
        if not 1 <= value <= 6:
            raise ValueError(f"{field}: {value} is out of range; accepted: 1..6")


def _options(name: str, query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    opts = dict(parse_qsl(query, keep_blank_values=True))
    for key in opts:
        if key not in allowed:
            raise ValueError(
                f"task: unknown option {key!r} in {name!r}; accepted: {', '.join(allowed)}"
            )
    return opts


def _int_option(opts: dict[str, str], key: str, default: int) -> int:
    try:
        return int(opts.get(key, default))
    except ValueError:
        raise ValueError(f"task: option {key}={opts[key]!r} is not an integer") from None


@functools.lru_cache(maxsize=256)
def parse_task_name(name: str) -> ArithmeticName | JsonlName:
    """The parsed task name, every option checked (see the module docstring). Memoised (the
    result is frozen): the spec's validator parses a name once per process and get_task, the
    estimate and the validation of a jsonl file reuse that parse."""
    if not isinstance(name, str) or not name:
        raise unknown_task(str(name))
    if name.startswith("jsonl:"):
        path, _, query = name[len("jsonl:") :].partition("?")
        if not path.strip():
            raise ValueError("task: 'jsonl:' needs a path, e.g. jsonl:/data/gsm8k.jsonl")
        match = _options(name, query, ("match",)).get("match", "exact")
        check_match(match)
        return JsonlName(name, path, match)
    base, _, query = name.partition("?")
    if base not in ARITHMETIC_OPS:
        raise unknown_task(name)
    allowed = (
        ("digits", "mul_digits", "mul_share") if base == "arithmetic" else ("digits", "mul_digits")
    )
    opts = _options(name, query, allowed)
    try:
        mul_share = float(opts.get("mul_share", 0.25))
    except ValueError:
        raise ValueError(f"task: option mul_share={opts['mul_share']!r} is not a number") from None
    parsed = ArithmeticName(
        name=name,
        ops=ARITHMETIC_OPS[base],
        digits=_int_option(opts, "digits", 2),
        mul_digits=_int_option(opts, "mul_digits", 1),
        mul_share=mul_share,
    )
    check_arithmetic(parsed.ops, parsed.digits, parsed.mul_digits, parsed.mul_share)
    return parsed
