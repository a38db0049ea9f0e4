"""Verifiable tasks: deterministic prompt generators and 0/1 reward functions.

No torch here. The names and their options are parsed in compute.contract.tasknames (the spec
validators use that, without building a task).

Task names accepted by `get_task`:
- ``arithmetic``      addition and multiplication, 3:1 (the zoo's task);
- ``arithmetic-add``  addition only;   ``arithmetic-mul``  multiplication only;
  each takes options after ``?``: ``digits`` (max digits of every addition operand and of the
  first multiplication operand, 1..6, default 2), ``mul_digits`` (max digits of the second
  multiplication operand, 1..6, default 1) and, for ``arithmetic``, ``mul_share`` (fraction of
  multiplications, 0..1, default 0.25), e.g. ``arithmetic-add?digits=3``.
  The default mix is chosen so the zoo calibrates well: 2-digit addition generalises from the
  train split to held-out problems, 2-digit x 1-digit multiplication only partly does;
- ``jsonl:PATH``      one ``{"prompt": ..., "answer": ...}`` object per line (an optional
  ``"split": "train"|"test"`` pins a line to a split). Options: ``jsonl:PATH?match=numeric``
  compares the first number of the completion with the answer's number (commas ignored, GSM8K
  style); ``match=exact`` (default) compares the completion's first line, stripped, with the
  answer, stripped.

Splits: every problem is assigned to ``train`` or ``test`` by a hash of the problem itself
(independent of the seed), about 20% test, so the two never overlap. ``examples(n, seed, split,
start)`` returns items ``start .. start+n-1`` of a sequence fixed by (task, seed, split), so prompt
ranges used as shards are disjoint and reproducible.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from compute.contract.tasknames import (
    ArithmeticName,
    check_arithmetic,
    check_match,
    parse_task_name,
)

SPLITS = ("train", "test")
TEST_PERCENT = 20  # share of problems held out for the test split (by hash)

# End-of-sequence markers that may appear in decoded completions; a completion ends at the first.
EOS_MARKERS = ("\n", "<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<pad>")

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def is_test(key: str) -> bool:
    """Split assignment of one problem, by hash (stable across runs, seeds and machines)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h % 100 < TEST_PERCENT


def cut_completion(completion: str) -> str:
    """The completion up to its first end-of-sequence marker or newline."""
    end = len(completion)
    for marker in EOS_MARKERS:
        i = completion.find(marker)
        if i != -1:
            end = min(end, i)
    return completion[:end]


def first_number(text: str) -> float | None:
    """The first number in `text` (commas inside numbers ignored), or None."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    try:
        return float(m.group(0).replace(",", ""))
    except ValueError:  # e.g. "-,"
        return None


def numeric_match(completion: str, answer: str) -> float:
    got = first_number(cut_completion(completion))
    want = first_number(answer)
    if got is None or want is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9) else 0.0


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if cut_completion(completion).strip() == answer.strip() else 0.0


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not accepted; accepted: train, test")


def _check_range(n: int, start: int) -> None:
    if n < 0:
        raise ValueError(f"n: {n} must be >= 0")
    if start < 0:
        raise ValueError(f"start: {start} must be >= 0")


class Task:
    """Base class: `name`, `examples(...)`, `reward(...)`."""

    name: str = "task"

    def examples(
        self, n: int, seed: int = 0, split: str = "train", start: int = 0
    ) -> list[Example]:
        raise NotImplementedError

    def reward(self, completion: str, answer: str) -> float:
        return numeric_match(completion, answer)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class ArithmeticTask(Task):
    """Integer addition/multiplication, prompt ``"12+34="`` and answer ``"46"``.

    Operands are uniform in [0, 10**digits); the second multiplication operand is uniform in
    [0, 10**mul_digits). With both ops, a problem is a multiplication with probability
    `mul_share`.
    """

    def __init__(
        self,
        name: str = "arithmetic",
        ops: tuple[str, ...] = ("+", "*"),
        digits: int = 2,
        mul_digits: int = 1,
        mul_share: float = 0.25,
    ) -> None:
        check_arithmetic(tuple(ops), digits, mul_digits, mul_share)
        self.name = name
        self.ops = tuple(ops)
        self.digits = digits
        self.mul_digits = mul_digits
        self.mul_share = mul_share

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        if len(self.ops) == 1:
            op = self.ops[0]
        else:
            op = "*" if rng.random() < self.mul_share else "+"
        a = rng.randrange(10**self.digits)
        b = rng.randrange(10 ** (self.digits if op == "+" else self.mul_digits))
        return a, op, b

    def examples(
        self, n: int, seed: int = 0, split: str = "train", start: int = 0
    ) -> list[Example]:
        _check_split(split)
        _check_range(n, start)
        want_test = split == "test"
        key = f"{self.ops}|{self.digits}|{self.mul_digits}|{self.mul_share}|{seed}|{split}"
        rng = random.Random(key)
        out: list[Example] = []
        i = 0
        while len(out) < n:
            a, op, b = self._draw(rng)
            prompt = f"{a}{op}{b}="
            if is_test(prompt) != want_test:
                continue
            if i >= start:
                out.append(Example(prompt, str(a + b if op == "+" else a * b)))
            i += 1
        return out

    def reward(self, completion: str, answer: str) -> float:
        return numeric_match(completion, answer)


class JsonlTask(Task):
    """A user's file of ``{"prompt": str, "answer": str|number}`` lines."""

    def __init__(self, path: str | Path, match: str = "exact") -> None:
        check_match(match)
        self.path = Path(path).expanduser()
        self.match = match
        self.name = f"jsonl:{path}" + ("?match=numeric" if match == "numeric" else "")
        if not self.path.is_file():
            raise ValueError(f"task: JSONL file {str(self.path)!r} does not exist")
        self.splits: dict[str, list[Example]] = {"train": [], "test": []}
        with self.path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                ex, split = self._parse(line, lineno)
                self.splits[split].append(ex)

    def _parse(self, line: str, lineno: int) -> tuple[Example, str]:
        where = f"task: {self.path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected an object with 'prompt' and 'answer'")
        prompt, answer = obj.get("prompt"), obj.get("answer")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: 'answer' must be a string or a number")
        answer = str(answer)
        if self.match == "numeric" and first_number(answer) is None:
            raise ValueError(f"{where}: 'answer' has no number but match=numeric")
        split = obj.get("split")
        if split is None:
            split = "test" if is_test(prompt) else "train"
        elif split not in SPLITS:
            raise ValueError(f"{where}: 'split' must be 'train' or 'test', got {split!r}")
        return Example(prompt, answer), split

    def examples(
        self, n: int, seed: int = 0, split: str = "train", start: int = 0
    ) -> list[Example]:
        """Items start..start+n-1 of a seeded shuffle of the split, reshuffled each pass."""
        _check_split(split)
        _check_range(n, start)
        items = self.splits[split]
        if not items and n > 0:
            raise ValueError(
                f"task: {self.path} has no {split} examples ({len(self.splits['train'])} train, "
                f'{len(self.splits["test"])} test); add lines or pin some with "split": "{split}"'
            )
        out: list[Example] = []
        perms: dict[int, list[int]] = {}
        for i in range(start, start + n):
            epoch, j = divmod(i, len(items))
            if epoch not in perms:
                perm = list(range(len(items)))
                random.Random(f"{self.path}|{seed}|{split}|{epoch}").shuffle(perm)
                perms[epoch] = perm
            out.append(items[perms[epoch][j]])
        return out

    def reward(self, completion: str, answer: str) -> float:
        if self.match == "numeric":
            return numeric_match(completion, answer)
        return exact_match(completion, answer)


def get_task(name: str) -> Task:
    """Task by name (see the module docstring). ValueError "task: ..." for unknown names."""
    parsed = parse_task_name(name)
    if isinstance(parsed, ArithmeticName):
        return ArithmeticTask(
            name=parsed.name, ops=parsed.ops, digits=parsed.digits, mul_digits=parsed.mul_digits,
            mul_share=parsed.mul_share,
        )
    return JsonlTask(parsed.path, match=parsed.match)
