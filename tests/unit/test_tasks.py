"""compute.lm.verifiable_tasks: deterministic, disjoint splits; rewards on hand cases; JSONL errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compute.lm.verifiable_tasks import (
    ArithmeticTask,
    Example,
    cut_completion,
    first_number,
    get_task,
)


@pytest.mark.parametrize("name", ["arithmetic", "arithmetic-add", "arithmetic-mul"])
def test_arithmetic_examples_are_correct_and_deterministic(name: str) -> None:
    task = get_task(name)
    a = task.examples(300, seed=3)
    assert a == get_task(name).examples(300, seed=3)
    assert a != task.examples(300, seed=4)
    for ex in a:
        assert isinstance(ex, Example)
        assert ex.prompt.endswith("=")
        expr = ex.prompt[:-1]
        op = "+" if "+" in expr else "*"
        x, y = (int(v) for v in expr.split(op))
        assert int(ex.answer) == (x + y if op == "+" else x * y)
    ops = {("+" if "+" in e.prompt else "*") for e in a}
    assert ops == {"arithmetic": {"+", "*"}, "arithmetic-add": {"+"}, "arithmetic-mul": {"*"}}[name]


def test_train_and_test_disjoint_across_seeds() -> None:
    task = get_task("arithmetic")
    train = {e.prompt for s in range(3) for e in task.examples(2000, seed=s, split="train")}
    test = {e.prompt for s in range(3) for e in task.examples(500, seed=s, split="test")}
    assert train and test and not train & test


def test_start_offsets_shard_the_sequence() -> None:
    task = get_task("arithmetic")
    whole = task.examples(30, seed=1, split="test")
    assert task.examples(10, seed=1, split="test", start=10) == whole[10:20]
    assert (
        task.examples(10, seed=1, split="test", start=0)
        + task.examples(20, seed=1, split="test", start=10)
        == whole
    )


def test_difficulty_options() -> None:
    task = get_task("arithmetic-add?digits=3")
    xs = [int(v) for e in task.examples(500) for v in e.prompt[:-1].split("+")]
    assert max(xs) >= 100 and max(xs) < 1000
    mul = get_task("arithmetic-mul?digits=1&mul_digits=2")
    ys = [int(e.prompt[:-1].split("*")[1]) for e in mul.examples(500)]
    assert max(ys) >= 10
    with pytest.raises(ValueError, match="digits"):
        get_task("arithmetic?digits=9")
    with pytest.raises(ValueError, match="unknown option 'foo'"):
        get_task("arithmetic?foo=1")


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("46", "46", 1.0),
        ("46<eos>", "46", 1.0),
        (" 46\n99", "46", 1.0),
        ("46</s>7", "46", 1.0),
        ("4", "46", 0.0),
        ("467", "46", 0.0),
        ("\n46", "46", 0.0),  # stops at the newline before any number
        ("", "46", 0.0),
        ("abc", "46", 0.0),
        ("-3", "-3", 1.0),
        ("46.0", "46", 1.0),
    ],
)
def test_arithmetic_reward(completion: str, answer: str, reward: float) -> None:
    assert get_task("arithmetic").reward(completion, answer) == reward


def test_helpers() -> None:
    assert cut_completion("12<eos>34") == "12"
    assert first_number("the answer is 1,234.") == 1234.0
    assert first_number("none") is None


def test_unknown_task_message() -> None:
    with pytest.raises(ValueError) as info:
        get_task("bogus")
    assert str(info.value) == (
        "task: unknown task 'bogus'; accepted: arithmetic, arithmetic-add, arithmetic-mul, jsonl:PATH"
    )


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_task(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}?", "answer": str(i)} for i in range(200)]
    path = _write(tmp_path / "data.jsonl", rows)
    task = get_task(f"jsonl:{path}")
    train = task.examples(50, seed=0)
    test = task.examples(20, seed=0, split="test")
    assert train == get_task(f"jsonl:{path}").examples(50, seed=0)
    assert {e.prompt for e in task.examples(500)} & {
        e.prompt for e in task.examples(500, split="test")
    } == set()
    assert {e.prompt for e in train} <= {r["prompt"] for r in rows}
    assert len(test) == 20
    # exact match by default (first line, stripped)
    assert task.reward(" 7 \nmore", "7") == 1.0
    assert task.reward("7.0", "7") == 0.0
    numeric = get_task(f"jsonl:{path}?match=numeric")
    assert numeric.reward("It is 7.0 apples", "7") == 1.0
    assert numeric.reward("1,234", "1234") == 1.0
    assert numeric.reward("8", "7") == 0.0
    # start offsets and wrap-around past the end of a small split are deterministic
    n_test = len(task.splits["test"])
    assert task.examples(5, split="test", start=3) == task.examples(8, split="test")[3:]
    assert len(task.examples(n_test * 2 + 1, split="test")) == n_test * 2 + 1


def test_jsonl_split_pinning_and_numbers(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "d.jsonl",
        [
            {"prompt": "a", "answer": 1, "split": "test"},
            {"prompt": "b", "answer": "2", "split": "train"},
        ],
    )
    task = get_task(f"jsonl:{path}")
    assert task.examples(1, split="test") == [Example("a", "1")]
    assert task.examples(1, split="train") == [Example("b", "2")]


@pytest.mark.parametrize(
    ("bad_line", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ('["a", "b"]', "expected an object"),
        ('{"answer": "1"}', "'prompt' must be a non-empty string"),
        ('{"prompt": "x"}', "'answer' must be a string or a number"),
        ('{"prompt": "x", "answer": "1", "split": "dev"}', "'split' must be"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(
    tmp_path: Path, bad_line: str, fragment: str
) -> None:
    path = _write(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "answer": "2"}, "", bad_line])
    with pytest.raises(ValueError) as info:
        get_task(f"jsonl:{path}")
    msg = str(info.value)
    assert msg.startswith("task: ")
    assert f"{path}:3" in msg and fragment in msg


def test_jsonl_missing_file_and_bad_option(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        get_task(f"jsonl:{tmp_path / 'nope.jsonl'}")
    path = _write(tmp_path / "d.jsonl", [{"prompt": "p", "answer": "x"}])
    with pytest.raises(ValueError, match="match='fuzzy'"):
        get_task(f"jsonl:{path}?match=fuzzy")
    with pytest.raises(ValueError, match="has no number"):
        get_task(f"jsonl:{path}?match=numeric")


def test_tasks_and_modelref_do_not_import_torch() -> None:
    code = "import sys, compute.lm.verifiable_tasks, compute.contract.modelref; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "name",
    ["arithmetic", "arithmetic-add?digits=3", "arithmetic-mul?mul_digits=2", "arithmetic?mul_share=1",
     "arithmetic?digits=7", "arithmetic?mul_digits=0", "arithmetic?mul_share=1.5", "arithmetic?mul_share=x",
     "arithmetic?digits=two", "arithmetic-add?mul_share=0.5", "arithmetic?x=1", "arith", "", "jsonl:",
     "jsonl:/no/such.jsonl?match=fuzzy", "jsonl:/no/such.jsonl?other=1"],
)
def test_the_contract_parses_task_names_as_get_task_builds_them(name: str) -> None:
    """compute.contract.tasknames (what the spec validators use, no task built) accepts exactly
    the names get_task builds, with the same error; get_task builds the parsed settings."""
    from compute.contract.tasknames import ArithmeticName, parse_task_name

    try:
        task = get_task(name)
    except ValueError as exc:
        with pytest.raises(ValueError) as parsed_exc:
            parse_task_name(name)
        assert str(parsed_exc.value) == str(exc)
        return
    parsed = parse_task_name(name)
    assert isinstance(parsed, ArithmeticName) and isinstance(task, ArithmeticTask)
    assert (task.ops, task.digits, task.mul_digits, task.mul_share) == (
        parsed.ops, parsed.digits, parsed.mul_digits, parsed.mul_share)
