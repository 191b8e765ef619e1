"""Tasks: where prompts come from and how completions are scored.

A task is a list of training examples {"prompt": str, "answer": str}, a held-out list of the same, and a
reward function `reward(prompt, completion, answer)`: a float in [0, 1], or a dense reward (check_dense).
`load_task(name)` builds one by name (the --task flag):

    copy                  "123=" -> "123", the built-in default; the tiny model learns it on a CPU
    copy:DIGITS[:dense]   the same with DIGITS digits; :dense pays each character, on its token, what it changes
    arithmetic            "12+7=" -> "19"; arithmetic:DIGITS sets the operands' digits (default 1, up to 9)
    addition              "What is 47 plus 28? Answer with the number only." -> "75", for chat models
    countdown             reach a target from 3-4 numbers with + - * /, equation inside <answer></answer>
    gsm8k                 grade-school math word problems (openai/gsm8k, needs `pip install datasets`)
    gsm8k:format          the same, plus 0.1 for putting the final answer after "####"
    jsonl:PATH            your prompts and answers, one {"prompt": ..., "answer": ...} a line; or your prompts
                          alone, {"prompt": ...} (with --reward-model: tasks/prompts.py)
    python:FILE.py:FUNC   your reward function FUNC(prompt, completion, answer) from FILE.py, with the
                          examples of its EXAMPLES list, or of a JSONL file: python:FILE.py:FUNC@DATA.jsonl

copy and arithmetic use only the characters of tiny_model.TINY_CHARS, so the built-in tiny model can read them;
the others are meant for hub models. The reward functions are in tasks/rewards.py; reading and checking your
own files is in tasks/user.py; the order prompts are drawn in is that of PromptSampler (machinery/batches.py).
"""

import inspect
import json
import math
import numbers
import random
from dataclasses import dataclass
from typing import Callable

from machinery.errors import UsageError, one_line, shorten
from tasks.prompts import read_examples, read_prompts_or_examples
from tasks.rewards import (
    arithmetic_reward,
    copy_dense_reward,
    copy_reward,
    countdown_reward,
    gsm8k_format_reward,
    gsm8k_reward,
    last_number_reward,
    match_reward,
    parse_number,
)
from tasks.user import as_user_code, python_reward_and_examples


@dataclass
class Task:
    name: str
    train: list  # [{"prompt": str, "answer": str}, ...]
    test: list
    reward_fn: Callable[[str, str, str], float]
    # How the reward uses the answer, for the checks of models.check_task: "written" (the completion must write
    # it, so the tokenizer must spell it within --max-new-tokens: refused if not), "data" (read by the reward,
    # never written: countdown's numbers), "yours" (your reward function: a note if the model could not write it),
    # "none" (prompts alone, jsonl:PATH without answers: scored by --reward-model only, machinery/gold.py).
    answers: str = "written"

    @property
    def wants_tokens(self):
        """Whether the reward function takes the completion's tokens (`tokens=`), for a per-token reward."""
        try:
            return "tokens" in inspect.signature(self.reward_fn).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            return False

    def score(self, prompts, completions, answers, tokens=None):
        """Rewards for a batch, checked: a reward function that raises anything (SystemExit included) or returns
        anything but a finite number or a dense reward (check_dense) stops the run in one line naming the prompt.
        `tokens`: each completion's tokens, as the text each writes, for a reward function that takes them
        (wants_tokens)."""
        rewards = []
        with as_user_code():
            for i, (prompt, completion, answer) in enumerate(zip(prompts, completions, answers)):
                try:
                    extra = {} if tokens is None else {"tokens": tokens[i]}
                    r = self.reward_fn(prompt, completion, answer, **extra)
                except BaseException as e:
                    raise UsageError(
                        f"reward function of task {self.name!r} raised {type(e).__name__}: {one_line(e)} "
                        f"on prompt {shorten(prompt)} and completion {shorten(completion)}: fix the reward function"
                    ) from None
                where = f"reward function of task {self.name!r} returned {shorten(r, 60)} on prompt {shorten(prompt)}"
                if isinstance(r, (list, tuple)):
                    rewards.append(check_dense(r, completion, where))
                    continue
                if finite_float(r) is None:
                    raise UsageError(f"{where} and completion {shorten(completion)}: it must return a finite number")
                rewards.append(finite_float(r))
        return rewards


def finite_float(value):
    """`value` as a finite float, or None: numbers.Real admits numpy scalars; bool is refused (True is almost always
    a bug here), and so is an int too large for a float (10**400)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def check_dense(reward, completion, where):
    """A dense reward, checked: [v, ...] one per token (EOS included; the length is checked where the tokens are
    known), or [(start, end, value), ...] spans of the completion's characters, each 0 <= start < end <= len."""
    if all(finite_float(v) is not None for v in reward):
        return [finite_float(v) for v in reward]
    for span in reward:
        if not (isinstance(span, (list, tuple)) and len(span) == 3 and finite_float(span[2]) is not None):
            raise UsageError(
                f"{where}: a dense reward is a list of finite numbers (one a token) or of "
                "(start, end, value) spans with a finite value"
            )
        start, end = span[0], span[1]
        odd = [i for i in (start, end) if not isinstance(i, numbers.Integral) or isinstance(i, bool)]
        if odd:
            raise UsageError(
                f"{where}: span ({shorten(start)}, {shorten(end)}) must give its start and end as whole "
                f"numbers (character positions in the completion), not {type(odd[0]).__name__}"
            )
        start, end = int(start), int(end)
        if not 0 <= start < end <= len(completion):
            raise UsageError(
                f"{where}: span ({shorten(start)}, {shorten(end)}) is not within the completion of "
                f"{len(completion)} characters (need 0 <= start < end <= {len(completion)})"
            )
    return [(int(start), int(end), finite_float(value)) for start, end, value in reward]


def split_examples(name, examples, seed=1234):
    """(train, test): a fixed-seed shuffle of the distinct prompts, then 10% of them (at least 1) held out.

    Every example of a prompt goes to the same side, so a prompt written twice never leaks into the
    held-out split. Without repeated prompts this is a shuffle of the examples themselves.
    """
    by_prompt = {}  # prompt -> its examples, in the order first seen
    for example in examples:
        by_prompt.setdefault(example["prompt"], []).append(example)
    if len(by_prompt) < 2:
        raise UsageError(
            f"task {name!r} has {len(by_prompt)} distinct prompt(s): "
            "it needs at least 2, one to train on and one held out"
        )
    groups = list(by_prompt.values())
    random.Random(seed).shuffle(groups)
    n_test = max(1, len(groups) // 10)
    return [ex for group in groups[n_test:] for ex in group], [ex for group in groups[:n_test] for ex in group]


# ---------------------------------------------------------------------------------------------------
# copy: the built-in default task. The tiny model learns it from scratch in a few minutes on a CPU.
# ---------------------------------------------------------------------------------------------------


def copy_task(digits=3, dense=False, max_examples=10_000, seed=1234):
    """Prompt "123=" -> answer "123": all 10**digits strings (1000 for the default 3: 900 to train on, 100
    held out), or `max_examples` distinct random ones when there are more. `dense`: copy_dense_reward, each
    character paid on its token what it changes of the score (copy:DIGITS:dense); else copy_reward, at the end.
    """
    rng = random.Random(seed)
    if 10**digits <= max_examples:
        strings = [f"{i:0{digits}d}" for i in range(10**digits)]
        rng.shuffle(strings)
    else:
        strings = list(dict.fromkeys("".join(rng.choices("0123456789", k=digits)) for _ in range(2 * max_examples)))
        strings = strings[:max_examples]
    examples = [{"prompt": f"{s}=", "answer": s} for s in strings]
    n_test = len(examples) // 10
    name = "copy" if (digits, dense) == (3, False) else f"copy:{digits}" + ":dense" * dense
    return Task(name, examples[n_test:], examples[:n_test], copy_dense_reward if dense else copy_reward)


def copy_form(arg):
    """copy:DIGITS or copy:DIGITS:dense, DIGITS from 1 to 20; copy:LOW-HIGH mixes as many prompts of each length
    LOW to HIGH, so a batch holds left-padded prompts (what verify.py's recommended dump needs)."""
    digits, _, dense = arg.partition(":")
    low, _, high = digits.partition("-")
    high = high or low
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high) <= 20 and dense in ("", "dense")):
        raise UsageError(
            f"task copy:{arg}: write copy:DIGITS, copy:LOW-HIGH or either with :dense, DIGITS from 1 "
            "to 20, e.g. copy:8:dense or copy:1-4"
        )
    tasks = [copy_task(d, dense == "dense") for d in range(int(low), int(high) + 1)]
    if len(tasks) == 1:
        return tasks[0]
    n_train, n_test = min(len(t.train) for t in tasks), min(len(t.test) for t in tasks)  # as many of each length
    train, test = [ex for t in tasks for ex in t.train[:n_train]], [ex for t in tasks for ex in t.test[:n_test]]
    random.Random(1234).shuffle(train)
    return Task(f"copy:{arg}", train, test, tasks[0].reward_fn)


# ---------------------------------------------------------------------------------------------------
# arithmetic: "12+7=" -> "19". Tiny-vocabulary, generated in code; arithmetic:DIGITS sets the difficulty.
# ---------------------------------------------------------------------------------------------------


def arithmetic_task(digits=1, max_examples=10_000, seed=1234):
    """Prompt "12+7=" -> answer "19": two `digits`-digit numbers (0-9 for one digit) joined by +, - or *.

    Up to `max_examples` distinct prompts (all 300 of them for one digit), 10% held out. The answer
    can be negative ("3-8=" -> "-5") and has up to 2 * digits characters; the tiny preset's
    max_new_tokens (5, EOS included) fits digits <= 2, more needs --max-new-tokens.
    """
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 9:
        raise UsageError(f"task arithmetic:{digits}: DIGITS must be a whole number from 1 to 9, e.g. arithmetic:2")
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    n = min(max_examples, 3 * (high - low + 1) ** 2)
    rng = random.Random(seed)
    answers = {}  # prompt -> answer; a dict keeps the prompts distinct and their order deterministic
    while len(answers) < n:
        a, b, op = rng.randint(low, high), rng.randint(low, high), rng.choice("+-*")
        answers[f"{a}{op}{b}="] = str({"+": a + b, "-": a - b, "*": a * b}[op])
    examples = [{"prompt": p, "answer": a} for p, a in answers.items()]
    name = f"arithmetic:{digits}"
    return Task(name, *split_examples(name, examples, seed), arithmetic_reward)


# ---------------------------------------------------------------------------------------------------
# addition: two-digit sums asked in words, for a small chat model (SmolLM2-135M-Instruct gets ~1 in 6).
# ---------------------------------------------------------------------------------------------------


ADDITION_PROMPT = "What is {a} plus {b}? Answer with the number only."


def addition_task(seed=1234):
    """All 8100 sums of two numbers from 10 to 99, asked in a sentence; 10% held out.

    Scored by last_number_reward: the last number of the completion must be the sum, so a chat model may
    answer "47 + 28 = 75" as well as "75", and the completion must stay short (at most 100 characters).
    """
    examples = [
        {"prompt": ADDITION_PROMPT.format(a=a, b=b), "answer": str(a + b)}
        for a in range(10, 100)
        for b in range(10, 100)
    ]
    return Task("addition", *split_examples("addition", examples, seed), last_number_reward)


# ---------------------------------------------------------------------------------------------------
# countdown: reach a target from 3-4 numbers with + - * / (as in TinyZero). Generated in code.
# ---------------------------------------------------------------------------------------------------


COUNTDOWN_PROMPT = (
    "Using the numbers {numbers}, write an equation that equals {target}. You can use +, -, *, / and each "
    "number at most once. Give the equation inside <answer></answer>, for example <answer>(1 + 2) / 3</answer>."
)


def countdown_target(numbers, rng):
    """Combine all `numbers` two at a time, in random order, with random operations; None if a step
    would leave the positive whole numbers (a - b <= 0 or a / b not whole). The result is reachable."""
    pool = list(numbers)
    while len(pool) > 1:
        a, b = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
        a, b = max(a, b), min(a, b)
        op = rng.choice("+-*/")
        if (op == "-" and a == b) or (op == "/" and a % b):
            return None
        pool.append({"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op])
    return pool[0]


def countdown_task(n_examples=10_000, seed=1234):
    """3 or 4 numbers from 1-99 and a target from 10-100 that they reach; `n_examples` distinct prompts, 10% held out.

    The target is built from all the numbers, but a solution may use any of them, each at most once.
    """
    rng = random.Random(seed)
    answers = {}  # prompt -> answer, distinct prompts in a deterministic order
    while len(answers) < n_examples:
        numbers = [rng.randint(1, 99) for _ in range(rng.choice((3, 4)))]
        target = countdown_target(numbers, rng)
        if target is None or not 10 <= target <= 100 or target in numbers:
            continue
        prompt = COUNTDOWN_PROMPT.format(numbers=numbers, target=target)
        answers[prompt] = json.dumps({"target": target, "numbers": numbers})
    examples = [{"prompt": p, "answer": a} for p, a in answers.items()]
    return Task("countdown", *split_examples("countdown", examples, seed), countdown_reward, answers="data")


# ---------------------------------------------------------------------------------------------------
# gsm8k: grade-school math word problems (Cobbe et al. 2021), from the hub through `datasets`.
# ---------------------------------------------------------------------------------------------------


GSM8K_PROMPT = "{question}\nSolve it step by step, then write the final answer as a number after ####."


def load_gsm8k_split(split):
    """The rows {"question": ..., "answer": "...reasoning...\\n#### 72"} of openai/gsm8k (config "main")."""
    try:
        import datasets
    except ImportError:
        raise UsageError("task gsm8k needs the datasets library: pip install datasets") from None
    try:
        return datasets.load_dataset("openai/gsm8k", "main", split=split)
    except Exception as e:  # no network, no cache, a hub outage: the user can only check the same things
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(
            f"could not load openai/gsm8k ({first_line}): check your network, or set HF_DATASETS_OFFLINE=1 "
            "to use a copy already in the cache"
        ) from None


def gsm8k_example(row, where):
    """A dataset row as an example: the question in GSM8K_PROMPT, the number after "####" as answer."""
    _, hashes, answer = row["answer"].rpartition("####")
    if not hashes or parse_number(answer) is None:
        raise UsageError(f'{where}: the answer has no "#### <number>" line; is this the openai/gsm8k format?')
    return {"prompt": GSM8K_PROMPT.format(question=row["question"].strip()), "answer": answer.strip().replace(",", "")}


def gsm8k_task(format_bonus=False, load_split=load_gsm8k_split):
    """The official train (7473) and test (1319) splits; `load_split(split)` gives the rows (tests pass a fixture)."""
    train, test = (
        [gsm8k_example(row, f"gsm8k {split} row {i}") for i, row in enumerate(load_split(split))]
        for split in ("train", "test")
    )
    if format_bonus:
        return Task("gsm8k:format", train, test, gsm8k_format_reward)
    return Task("gsm8k", train, test, gsm8k_reward)


# ---------------------------------------------------------------------------------------------------
# jsonl:PATH and python:FILE.py:FUNCTION: your own data, your own reward function (read in tasks/user.py).
# ---------------------------------------------------------------------------------------------------


def jsonl_task(path):
    """Your examples, one {"prompt": ..., "answer": ...} a line, scored by match_reward; or your prompts alone
    (tasks/prompts.py), scored by --reward-model only; 10% held out."""
    name = f"jsonl:{path}"
    examples, prompts_only = read_examples(path)
    return Task(name, *split_examples(name, examples), match_reward, answers="none" if prompts_only else "written")


def python_task(spec):
    """`FILE.py:FUNCTION` or `FILE.py:FUNCTION@DATA.jsonl`: the reward FUNCTION(prompt, completion, answer)
    of your file, on the examples of its module-level EXAMPLES list, or of DATA.jsonl when given.

    A reward function that raises or returns anything but a finite number stops the run with a message
    naming the prompt and completion (Task.score).
    """
    reward_fn, examples = python_reward_and_examples(spec, read_prompts_or_examples)
    name = f"python:{spec}"
    return Task(name, *split_examples(name, examples), reward_fn, answers="yours")


# ---------------------------------------------------------------------------------------------------
# Task names.
# ---------------------------------------------------------------------------------------------------


TASKS = {
    "copy": copy_task,
    "arithmetic": arithmetic_task,
    "addition": addition_task,
    "countdown": countdown_task,
    "gsm8k": gsm8k_task,
    "gsm8k:format": lambda: gsm8k_task(format_bonus=True),
}

# Tasks written NAME:ARGUMENT, by NAME: how the form is written, and the function that takes ARGUMENT.
TASK_FORMS = {
    "copy": ("copy:DIGITS[:dense]", copy_form),
    "arithmetic": ("arithmetic:DIGITS", lambda arg: arithmetic_task(int(arg) if arg.isdigit() else arg)),
    "jsonl": ("jsonl:PATH", jsonl_task),
    "python": ("python:FILE.py:FUNCTION[@DATA.jsonl]", python_task),
}


def load_task(name):
    """The task called `name`: a name in TASKS, or a form of TASK_FORMS such as jsonl:data.jsonl."""
    if name in TASKS:
        return TASKS[name]()
    kind, _, arg = name.partition(":")
    if kind in TASK_FORMS and arg:
        return TASK_FORMS[kind][1](arg)
    valid = [*TASKS, *(form for form, _ in TASK_FORMS.values())]
    raise UsageError(f"unknown task {name!r}: pass --task with one of {', '.join(valid)}")
