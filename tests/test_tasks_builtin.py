"""tasks.py: the built-in tasks (arithmetic, countdown, gsm8k) and the user tasks (jsonl:, python:).

Rewards by hand, the countdown verifier against code injection and huge inputs, gsm8k's answer extraction
on the real dataset's format, and that every kind of bad user input stops with a clear UsageError.
"""

import builtins
import contextlib
import itertools
import json
import operator
import os
import re
import signal
import types
from fractions import Fraction

import pytest

import tasks
from machinery import bookkeeping, models
from machinery.errors import UsageError
from machinery.tiny_model import TINY_CHARS
from tasks import load_task, rewards

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


@contextlib.contextmanager
def deadline(seconds):
    """Fail (instead of hanging the suite) when the block runs longer than `seconds`."""

    def expire(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------------------------------------------
# arithmetic
# ---------------------------------------------------------------------------------------------------

ARITHMETIC = re.compile(r"(\d+)([+*-])(\d+)=")
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_arithmetic_examples_are_right_and_of_the_asked_difficulty(digits):
    task = load_task(f"arithmetic:{digits}")
    examples = task.train + task.test
    assert task.name == f"arithmetic:{digits}"
    assert len(examples) == (300 if digits == 1 else 10_000)  # all 3 * 10 * 10 one-digit prompts
    assert len({ex["prompt"] for ex in examples}) == len(examples)
    assert not {ex["prompt"] for ex in task.train} & {ex["prompt"] for ex in task.test}
    assert len(task.test) == len(examples) // 10
    low = 0 if digits == 1 else 10 ** (digits - 1)
    for ex in examples:
        a, op, b = ARITHMETIC.fullmatch(ex["prompt"]).groups()
        assert len(a) == len(b) == digits and low <= int(a) and low <= int(b)
        assert ex["answer"] == str(OPS[op](int(a), int(b)))
        assert len(ex["answer"]) <= 2 * digits  # what the docstring promises for max_new_tokens


def test_arithmetic_default_is_one_digit_and_deterministic():
    assert load_task("arithmetic").train == load_task("arithmetic:1").train
    assert tasks.arithmetic_task(2).train == tasks.arithmetic_task(2).train


@pytest.mark.parametrize("digits", [1, 2, 9])
def test_arithmetic_uses_only_the_tiny_models_characters(digits, tiny_tokenizer):
    task = load_task(f"arithmetic:{digits}")
    for ex in task.train + task.test:
        assert set(ex["prompt"] + ex["answer"]) <= set(TINY_CHARS), ex
    models.check_vocabulary(tiny_tokenizer, task, "tiny")  # the tiny tokenizer reads every prompt


def test_check_vocabulary_refuses_a_task_the_tiny_tokenizer_cannot_read(tiny_tokenizer):
    """The negative control of the test above: countdown's prompts have letters."""
    with pytest.raises(UsageError, match="does not know"):
        models.check_vocabulary(tiny_tokenizer, load_task("countdown"), "tiny")


@pytest.mark.parametrize("name", ["arithmetic:0", "arithmetic:10", "arithmetic:two", "arithmetic:-1", "arithmetic:1.5"])
def test_arithmetic_bad_difficulty_is_a_usage_error(name):
    with pytest.raises(UsageError, match="DIGITS"):
        load_task(name)


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("19", "19", 1.0),
        (" 19\n", "19", 1.0),
        ("-5", "-5", 1.0),
        ("5", "-5", 0.0),
        ("019", "19", 0.0),
        ("19.0", "19", 0.0),
        ("1", "19", 0.0),
        ("1919", "19", 0.0),
        ("", "19", 0.0),
        ("19=19", "19", 0.0),
    ],
)
def test_arithmetic_reward_is_exact_match(completion, answer, reward):
    assert rewards.arithmetic_reward("12+7=", completion, answer) == reward


# ---------------------------------------------------------------------------------------------------
# countdown
# ---------------------------------------------------------------------------------------------------


def countdown_answer(target, numbers):
    return json.dumps({"target": target, "numbers": numbers})


@pytest.mark.parametrize(
    "equation, numbers, value",
    [
        ("(1 + 2) * 3", [1, 2, 3], 9),
        ("(1 + 2) * 3 = 9", [1, 2, 3], 9),
        ("50 / 2", [2, 50], 25),
        ("7 / 2", [2, 7], Fraction(7, 2)),
        ("3 * 3", [3, 3, 5], 9),
        ("25 - 50", [25, 50], -25),
        (" 7 ", [7], 7),
    ],
)
def test_countdown_value_of_well_formed_equations(equation, numbers, value):
    result = rewards.countdown_value(equation, numbers)
    assert result == value and isinstance(result, Fraction)


MALICIOUS = [
    "__import__('os').system('x')",
    "2**99999999",
    "9**9**9**9",
    "(lambda: 1)()",
    "open('/etc/passwd').read()",
    "().__class__.__bases__[0].__subclasses__()",
    "1 + 4",  # 4 is not in the list
    "3 * 3",  # 3 is given once
    "1 / (2 - 2)",  # division by zero
    "-1 + 2 + 3",  # unary minus
    "7 // 2",
    "7 % 2",
    "1.5 * 2",
    "1 +",
    "",
    "(" * 49 + "1" + ")" * 49,  # deeply nested, within the length limit: well formed, value 1
    "(" * 5000 + "1" + ")" * 5000,
    "1 + " * 100_000 + "1",
    "9" * 1_000_000,
]


@pytest.mark.parametrize("equation", MALICIOUS, ids=lambda e: e[:30])
def test_countdown_never_executes_or_hangs_on_malicious_equations(equation, monkeypatch):
    """Model text is parsed, never run: eval, exec, os.system and importing os would all raise here."""
    calls = []
    real_import = builtins.__import__

    def forbidden(*args, **kwargs):
        calls.append(args[:1])
        raise AssertionError("the verifier executed model text")

    def guarded_import(name, *args, **kwargs):  # ast.walk itself imports collections: only these are refused
        return forbidden(name) if name in ("os", "subprocess", "shutil") else real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    monkeypatch.setattr(builtins, "__import__", guarded_import)
    monkeypatch.setattr(os, "system", forbidden)
    answer = countdown_answer(6, [1, 2, 2, 3])
    try:
        with deadline(2):
            value = rewards.countdown_value(equation, [1, 2, 2, 3])
            reward = rewards.countdown_reward("", f"<answer>{equation}</answer>", answer)
    finally:
        monkeypatch.undo()  # now, not at teardown: pytest itself imports while it reports a failure
    assert not calls
    if equation.startswith("(((") and len(equation) < 100:
        assert value == 1 and reward == 0.1
    else:
        assert value is None and reward == 0.0


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("<answer>(1 + 2) * 3</answer>", 1.0),
        ("Let me think. 1 + 2 = 3, 3 * 3 = 9.\n<answer>(1 + 2) * 3 = 9</answer>", 1.0),
        ("<answer>1 + 2 + 3</answer>", 0.1),  # well formed, misses the target
        ("<answer>9</answer>", 0.0),  # 9 is not one of the numbers
        ("(1 + 2) * 3", 0.0),  # no tags
        ("<answer>(1 + 2) * 3", 0.0),  # unclosed
        ("<answer>1 + 2 + 3</answer> no wait <answer>(1 + 2) * 3</answer>", 1.0),  # the last one counts
        ("<answer>(1 + 2) * 3</answer> no wait <answer>1 + 2 + 3</answer>", 0.1),
        ("<answer>(1 + 2) * 3</answer><answer>", 1.0),
    ],
)
def test_countdown_reward_hand_values(completion, reward):
    assert rewards.countdown_reward("", completion, countdown_answer(9, [1, 2, 3])) == reward


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<answer>" * 50_000, 0.0),  # no closing tag
        ("<answer>" * 20_000 + "(1 + 2) * 3</answer>" * 20_000, 0.0),  # the last pair holds tags: not an equation
        ("x" * 5_000_000, 0.0),
        ("<answer>" + "1 + " * 1_000_000 + "</answer>", 0.0),  # over countdown_value's 100 characters
        ("</answer><answer>" * 100_000, 0.0),  # the last pair is empty
        ("x" * 5_000_000 + "<answer>(1 + 2) * 3</answer>", 1.0),  # a right answer after a huge text still counts
        ("<answer>" * 50_000 + "<answer>1 + 2 + 3</answer>", 0.1),
    ],  # a well-formed miss after many open tags
    ids=[
        "unclosed-tags",
        "many-tags",
        "long-text",
        "long-equation",
        "alternating-tags",
        "right-after-long-text",
        "miss-after-open-tags",
    ],
)
def test_countdown_reward_is_fast_on_huge_completions(completion, expected):
    """Fast, and still the exact reward: guards a search that gives up (or a length cap that scores 0) on long
    text, as much as one that takes quadratic time."""
    with deadline(2):
        reward = rewards.countdown_reward("", completion, countdown_answer(9, [1, 2, 3]))
    assert reward == expected


def reachable(numbers, target):
    """Brute force, independent of countdown_target: can some of `numbers` combined with + - * / reach `target`?"""
    values = [Fraction(n) for n in numbers]
    if target in values:
        return True
    for i, j in itertools.permutations(range(len(values)), 2):
        rest = [v for k, v in enumerate(values) if k not in (i, j)]
        a, b = values[i], values[j]
        results = [a + b, a - b, a * b] + ([a / b] if b else [])
        if any(reachable(rest + [r], target) for r in results):
            return True
    return False


def test_countdown_task_targets_are_reachable():
    task = tasks.countdown_task(n_examples=60)
    assert len(task.train) == 54 and len(task.test) == 6
    for ex in task.train[:20]:
        spec = json.loads(ex["answer"])
        assert 3 <= len(spec["numbers"]) <= 4 and all(1 <= n <= 99 for n in spec["numbers"])
        assert 10 <= spec["target"] <= 100 and spec["target"] not in spec["numbers"]
        assert str(spec["numbers"]) in ex["prompt"] and str(spec["target"]) in ex["prompt"]
        assert reachable(spec["numbers"], spec["target"]), spec


def test_countdown_default_task():
    task = load_task("countdown")
    assert len(task.train) == 9000 and len(task.test) == 1000


# ---------------------------------------------------------------------------------------------------
# gsm8k: answer extraction on the real format, the loader through its load_split injection point.
# ---------------------------------------------------------------------------------------------------


def fixture_rows():
    with open(os.path.join(FIXTURES, "gsm8k_sample.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def fixture_task(format_bonus=False):
    rows = fixture_rows()
    return tasks.gsm8k_task(format_bonus, load_split=lambda split: rows if split == "train" else rows[:2])


def test_gsm8k_loader_reads_the_dataset_format():
    task = fixture_task()
    assert task.name == "gsm8k" and len(task.train) == 5 and len(task.test) == 2
    assert [ex["answer"] for ex in task.train] == ["72", "50", "1440", "105", "5"]  # "#### 1,440" -> "1440"
    first = fixture_rows()[0]
    assert task.train[0]["prompt"] == tasks.GSM8K_PROMPT.format(question=first["question"])
    assert "####" not in task.train[0]["prompt"].split("\n")[0]  # the reference solution is never in the prompt
    assert fixture_task(format_bonus=True).name == "gsm8k:format"


def test_gsm8k_reference_solutions_score_1():
    """Each row's own worked solution, as a completion, gets full reward against its answer."""
    task = fixture_task()
    rows = fixture_rows()
    rewards = task.score(
        [ex["prompt"] for ex in task.train], [row["answer"] for row in rows], [ex["answer"] for ex in task.train]
    )
    assert rewards == [1.0] * 5


@pytest.mark.parametrize(
    "completion, final",
    [
        ("3*24=<<3*24=72>>72 pencils.\n#### 72", "72"),
        ("#### 1,440", "1,440"),
        ("#### $1,440", "1,440"),
        ("The answer is \\boxed{1,440}.", "1,440"),
        ("\\boxed{\\text{1440 dollars}}", "1440"),
        ("so 18*40=720 and 720*2=1440.", "1440"),
        ("she has -5 left", "-5"),
        ("12-7=5", "5"),
        ("#### 72\nBut then 99 more", "72"),
        ("\\boxed{7} but #### 8", "8"),
        ("#### no number here, 3", "3"),
        ("It is $1440.00", "1440.00"),
        ("no digits", None),
        ("", None),
    ],
)
def test_gsm8k_final_number(completion, final):
    assert rewards.gsm8k_final_number(completion) == final


@pytest.mark.parametrize(
    "completion, reward, format_reward",
    [
        ("... #### 1440", 1.0, 1.0),
        ("... #### 1,440", 1.0, 1.0),
        ("... #### $1,440.00", 1.0, 1.0),
        ("She earns $1,440.", 1.0, 1.0),
        ("The answer is 1440.0", 1.0, 1.0),
        ("\\boxed{1440}", 1.0, 1.0),
        ("... #### 1441", 0.0, 0.1),
        ("#### -1440", 0.0, 0.1),
        ("She earns 1441 dollars.", 0.0, 0.0),
        ("14400", 0.0, 0.0),
        ("144", 0.0, 0.0),
        ("I do not know", 0.0, 0.0),
    ],
)
def test_gsm8k_rewards_on_the_1440_row(completion, reward, format_reward):
    task, format_task = fixture_task(), fixture_task(format_bonus=True)
    prompt, answer = task.train[2]["prompt"], task.train[2]["answer"]
    assert answer == "1440"
    assert task.score([prompt], [completion], [answer]) == [reward]
    assert format_task.score([prompt], [completion], [answer]) == [format_reward]


@pytest.mark.parametrize(
    "completion", ["1" * 100_000, "#### " + "9" * 5000, "111," * 100_000, "\\boxed{" * 20_000, "1e999999999"]
)
def test_gsm8k_reward_survives_huge_numbers(completion):
    """A degenerate completion (thousands of digits) scores 0; it must not stop the run or hang."""
    with deadline(2):
        assert rewards.gsm8k_reward("", completion, "72") == 0.0
        assert rewards.match_reward("", completion, "72") == 0.0


def test_gsm8k_row_without_hashes_is_a_usage_error():
    rows = [{"question": "How many?", "answer": "It is 4."}] * 2
    with pytest.raises(UsageError, match="gsm8k train row 0.*####"):
        tasks.gsm8k_task(load_split=lambda split: rows)


def test_gsm8k_without_datasets_gives_a_one_line_message(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # `import datasets` now raises ImportError
    with pytest.raises(UsageError, match="pip install datasets"):
        load_task("gsm8k")
    with pytest.raises(SystemExit) as exit_info:
        bookkeeping.run_main(lambda: load_task("gsm8k:format"))
    message = str(exit_info.value.code)
    assert message == "error: task gsm8k needs the datasets library: pip install datasets"


def test_gsm8k_download_failure_is_a_usage_error(monkeypatch):
    """A stand-in `datasets` whose download fails: the test needs no optional package and no network."""

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nlong details")

    monkeypatch.setitem(__import__("sys").modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(UsageError, match=r"could not load openai/gsm8k \(Couldn't reach .*\): check your network") as e:
        load_task("gsm8k")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------
# jsonl:PATH
# ---------------------------------------------------------------------------------------------------


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_jsonl_good_file(tmp_path):
    rows = [json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) for i in range(9)]
    rows.insert(3, "")  # blank lines are skipped
    rows.append(json.dumps({"prompt": "price of 2 cups at 1.75?", "answer": 3.5}))  # a number as answer
    path = write_lines(tmp_path / "data.jsonl", rows)
    task = load_task(f"jsonl:{path}")
    examples = task.train + task.test
    assert task.name == f"jsonl:{path}" and len(task.train) == 9 and len(task.test) == 1
    assert {"prompt": "price of 2 cups at 1.75?", "answer": "3.5"} in examples
    assert {"prompt": "4+4=", "answer": "8"} in examples
    scores = task.score(["q"] * 5, ["8", " 8\n", "3.50", "8.0", "9"], ["8", "8", "3.5", "8", "8"])
    assert scores == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_jsonl_bad_json_names_file_and_line(tmp_path):
    path = write_lines(
        tmp_path / "bad.jsonl", ['{"prompt": "1=", "answer": "1"}', "", "{'prompt': '2=', 'answer': '2'}"]
    )
    with pytest.raises(UsageError, match=rf"{re.escape(path)}, line 3: not valid JSON"):
        load_task(f"jsonl:{path}")


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "1="}, 'has no "answer" while line 1 has one: give every line an "answer", or none'),
        ({"answer": "1"}, 'the key "prompt" is missing'),
        ({"prompt": "", "answer": "1"}, '"prompt" must be a non-empty string'),
        ({"prompt": "1=", "answer": None}, '"answer" must be'),
        ({"prompt": "1=", "answer": True}, '"answer" must be'),
        (["1=", "1"], "expected an object"),
    ],
)
def test_jsonl_bad_row_names_file_line_and_key(tmp_path, row, message):
    path = write_lines(tmp_path / "rows.jsonl", [json.dumps({"prompt": "1=", "answer": "1"}), json.dumps(row)])
    with pytest.raises(UsageError, match=rf"{re.escape(path)}, line 2\b.*{re.escape(message)}"):
        load_task(f"jsonl:{path}")


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(UsageError, match=r"cannot read .*nope\.jsonl.*check the path"):
        load_task(f"jsonl:{tmp_path / 'nope.jsonl'}")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_jsonl_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match="is empty"):
        load_task(f"jsonl:{path}")


def test_jsonl_single_example_and_non_utf8(tmp_path):
    path = write_lines(tmp_path / "one.jsonl", [json.dumps({"prompt": "1=", "answer": "1"})])
    with pytest.raises(UsageError, match="at least 2"):
        load_task(f"jsonl:{path}")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(UsageError, match="not UTF-8"):
        load_task(f"jsonl:{latin}")


# ---------------------------------------------------------------------------------------------------
# python:FILE.py:FUNC
# ---------------------------------------------------------------------------------------------------

REWARD_FILE = """
EXAMPLES = [{"prompt": f"say {i}", "answer": str(i)} for i in range(10)]


def length_reward(prompt, completion, answer):
    return min(1.0, len(completion) / 10)


def exact(prompt, completion, answer):
    return float(completion.strip() == answer)


def raises(prompt, completion, answer):
    return {}[answer]


def nan(prompt, completion, answer):
    return float("nan")


def text(prompt, completion, answer):
    return "1.0"


def two_args(prompt, completion):
    return 1.0


NOT_A_FUNCTION = 3
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return str(path)


def test_python_task_good_reward_file(reward_file, tmp_path):
    task = load_task(f"python:{reward_file}:exact")
    assert len(task.train) == 9 and len(task.test) == 1
    assert task.score(["say 3", "say 3"], ["3", "4"], ["3", "3"]) == [1.0, 0.0]
    assert load_task(f"python:{reward_file}:length_reward").score(["p"], ["abcde"], ["x"]) == [0.5]
    data = write_lines(tmp_path / "data.jsonl", [json.dumps({"prompt": f"q{i}", "answer": "a"}) for i in range(4)])
    with_data = load_task(f"python:{reward_file}:exact@{data}")
    assert {ex["prompt"] for ex in with_data.train + with_data.test} == {"q0", "q1", "q2", "q3"}


def test_python_reward_that_raises_names_prompt_and_completion(reward_file):
    task = load_task(f"python:{reward_file}:raises")
    with pytest.raises(UsageError, match=r"raised KeyError: '7' on prompt 'say 7' and completion 'seven'"):
        task.score(["say 7"], ["seven"], ["7"])


@pytest.mark.parametrize("function, shown", [("nan", "nan"), ("text", "'1.0'")])
def test_python_reward_returning_a_non_number(reward_file, function, shown):
    task = load_task(f"python:{reward_file}:{function}")
    with pytest.raises(UsageError, match=rf"returned {shown} on prompt 'say 1' and completion '1'.*finite number"):
        task.score(["say 1"], ["1"], ["1"])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{file}:missing", r"has no 'missing'; its functions are: exact, length_reward, nan, raises, text, two_args"),
        ("{file}:NOT_A_FUNCTION", "is a int, not a function"),
        ("{file}:two_args", r"must take \(prompt, completion, answer\)"),
        ("{dir}/nope.py:f", "there is no file"),
        ("{file}", "write python:FILE.py:FUNCTION"),
        ("{dir}/data.txt:f", "write python:FILE.py:FUNCTION"),
    ],
)
def test_python_task_bad_spec(reward_file, tmp_path, spec, message):
    with pytest.raises(UsageError, match=message):
        load_task("python:" + spec.format(file=reward_file, dir=tmp_path))


def test_python_file_that_fails_to_import_or_lacks_examples(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(UsageError, match=r"importing .*broken\.py raised ModuleNotFoundError"):
        load_task(f"python:{broken}:f")
    bare = tmp_path / "bare.py"
    bare.write_text("def f(prompt, completion, answer):\n    return 1.0\n")
    with pytest.raises(UsageError, match="has no EXAMPLES list"):
        load_task(f"python:{bare}:f")
