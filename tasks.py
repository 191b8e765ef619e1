"""Tasks: where prompts come from and how completions are scored.

A task is a list of training examples {"prompt": str, "answer": str}, a held-out list of the same, and a
reward function `reward(prompt, completion, answer) -> float` in [0, 1]. `load_task(name)` builds one by name
(the --task flag):

    copy                  "123=" -> "123", the built-in default; the tiny model learns it on a CPU
    arithmetic            "12+7=" -> "19"; arithmetic:DIGITS sets the operands' digits (default 1, up to 9)
    countdown             reach a target from 3-4 numbers with + - * /, equation inside <answer></answer>
    gsm8k                 grade-school math word problems (openai/gsm8k, needs `pip install datasets`)
    gsm8k:format          the same, plus 0.1 for putting the final answer after "####"
    jsonl:PATH            your prompts and answers, one {"prompt": ..., "answer": ...} a line
    python:FILE.py:FUNC   your reward function FUNC(prompt, completion, answer) from FILE.py, with the
                          examples of its EXAMPLES list, or of a JSONL file: python:FILE.py:FUNC@DATA.jsonl

copy and arithmetic use only the characters of common.TINY_CHARS, so the built-in tiny model can read them;
the others are meant for hub models. Each reward is a small pure function with its rule in its docstring.
"""

import ast
import importlib.util
import inspect
import json
import math
import numbers
import operator
import os
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import torch

from common import UsageError, load_pretrained, load_tokenizer


@dataclass
class Task:
    name: str
    train: list  # [{"prompt": str, "answer": str}, ...]
    test: list
    reward_fn: Callable[[str, str, str], float]

    def score(self, prompts, completions, answers):
        """Rewards for a batch, checked: a reward function that raises or returns a non-number stops the run."""
        rewards = []
        for prompt, completion, answer in zip(prompts, completions, answers):
            try:
                r = self.reward_fn(prompt, completion, answer)
            except Exception as e:
                raise UsageError(
                    f"reward function of task {self.name!r} raised {type(e).__name__}: {e} "
                    f"on prompt {shorten(prompt)} and completion {shorten(completion)}: fix the reward function"
                ) from None
            # numbers.Real also admits numpy scalars; bool is excluded, as True is almost always a bug here.
            if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r):
                raise UsageError(
                    f"reward function of task {self.name!r} returned {shorten(r)} on prompt {shorten(prompt)} "
                    f"and completion {shorten(completion)}: it must return a finite number"
                )
            rewards.append(float(r))
        return rewards


def shorten(value, limit=200):
    """repr(value) on one line, cut to about `limit` characters, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PromptSampler:
    """Endless shuffled passes over the training examples, with its own seeded RNG (so resumable)."""

    def __init__(self, examples, seed):
        self.examples, self.rng, self.order = examples, random.Random(seed), []

    def sample(self, n):
        batch = []
        while len(batch) < n:
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
            batch.append(self.examples[self.order.pop()])
        return batch

    def state_dict(self):
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state_dict(self, state):
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])


class RewardModel:
    """--reward-model: a sequence-classification model with one output scores each prompt + completion.

    The canonical RLHF setup (Ouyang et al. 2022). The text is re-tokenised with the reward model's own
    tokenizer (through its chat template when it has one), so it need not share the policy's tokenizer.
    """

    def __init__(self, name, device, dtype, batch_size=16):
        from transformers import AutoModelForSequenceClassification

        self.name, self.batch_size = f"reward model {name}", batch_size
        self.tokenizer = load_tokenizer(name)
        self.tokenizer.padding_side = "right"
        self.model = load_pretrained(AutoModelForSequenceClassification, name, device, dtype).eval()
        if self.model.config.num_labels != 1:
            raise UsageError(f"--reward-model {name!r} has {self.model.config.num_labels} outputs: a reward model has 1")
        if self.model.config.pad_token_id is None:  # it finds each row's last token through the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def score(self, prompts, completions, answers):
        templated = bool(self.tokenizer.chat_template)
        if templated:
            chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": c}] for p, c in zip(prompts, completions)]
            texts = self.tokenizer.apply_chat_template(chats, tokenize=False)
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        scores = []
        with torch.no_grad():
            for i in range(0, len(texts), self.batch_size):
                # A rendered template already holds its BOS: adding special tokens again would give two.
                enc = self.tokenizer(texts[i : i + self.batch_size], return_tensors="pt", padding=True, add_special_tokens=not templated)
                enc = enc.to(self.model.device)
                scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores


# ---------------------------------------------------------------------------------------------------
# copy: the built-in default task. The tiny model learns it from scratch in a few minutes on a CPU.
# ---------------------------------------------------------------------------------------------------


def copy_reward(prompt, completion, answer):
    """Share of characters in the right place, over the longer of answer and completion.

    A random completion gets about 0.1 per digit; only the exact copy followed by EOS gets 1.
    There is no credit for format alone, so no constant answer can trap the policy.
    """
    hits = sum(a == c for a, c in zip(answer, completion))
    return hits / max(len(answer), len(completion))


def copy_task(digits=3, seed=1234):
    """Prompt "123=" -> answer "123": all 1000 three-digit strings, 900 to train on and 100 held out."""
    strings = [f"{i:0{digits}d}" for i in range(10**digits)]
    random.Random(seed).shuffle(strings)
    examples = [{"prompt": f"{s}=", "answer": s} for s in strings]
    n_test = len(examples) // 10
    return Task("copy", examples[n_test:], examples[:n_test], copy_reward)


# ---------------------------------------------------------------------------------------------------
# Shared by the tasks below: the held-out split, reading and checking examples, reading numbers.
# ---------------------------------------------------------------------------------------------------


def split_examples(name, examples, seed=1234):
    """(train, test): a fixed-seed shuffle, then 10% of the examples (at least 1) held out."""
    if len(examples) < 2:
        raise UsageError(
            f"task {name!r} has {len(examples)} example(s): it needs at least 2, one to train on and one held out"
        )
    examples = list(examples)
    random.Random(seed).shuffle(examples)
    n_test = max(1, len(examples) // 10)
    return examples[n_test:], examples[:n_test]


def check_example(row, where):
    """`row` as {"prompt": str, "answer": str}, or a UsageError saying what is wrong at `where`.

    A number as answer is accepted and turned into its string: {"prompt": "2+2=", "answer": 4}.
    """
    if not isinstance(row, dict):
        raise UsageError(f'{where}: expected an object like {{"prompt": "...", "answer": "..."}}, not {shorten(row)}')
    for key in ("prompt", "answer"):
        if key not in row:
            raise UsageError(f'{where}: the key "{key}" is missing; every example needs "prompt" and "answer"')
    prompt, answer = row["prompt"], row["answer"]
    if not isinstance(prompt, str) or not prompt:
        raise UsageError(f'{where}: "prompt" must be a non-empty string, not {shorten(prompt)}')
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise UsageError(f'{where}: "answer" must be a string or a number, not {shorten(answer)}')
    return {"prompt": prompt, "answer": answer}


def read_jsonl(path):
    """The examples of a JSONL file, one {"prompt": ..., "answer": ...} object a line; blank lines are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise UsageError(f"cannot read {path!r} ({e.strerror}): check the path") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text: save it as UTF-8 JSONL") from None
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(
                f'{path}, line {number}: not valid JSON ({e.msg}); write one object like {{"prompt": "...", '
                f'"answer": "..."}} per line'
            ) from None
        examples.append(check_example(row, f"{path}, line {number}"))
    if not examples:
        raise UsageError(f'{path} is empty: write one {{"prompt": "...", "answer": "..."}} object per line')
    return examples


# A number as people write it: optional minus, digits (maybe grouped by commas: 1,000), optional decimals.
# (?<!\d) keeps the "-" of "12-7" from being read as a sign.
NUMBER = re.compile(r"(?<!\d)-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def parse_number(text):
    """`text` as an exact Fraction, or None: "1,000", "$1000", "1000.00" all give 1000.

    Only plain decimals of at most 1000 characters parse (no "1e9", "nan", "inf"): a completion like
    "1e999999999" or a run of 5000 digits must not build a huge integer, or stop the run (Python refuses
    to read an integer of more than 4300 digits).
    """
    text = text.strip().removeprefix("$")
    if len(text) > 1000 or not NUMBER.fullmatch(text):
        return None
    return Fraction(text.replace(",", ""))


# ---------------------------------------------------------------------------------------------------
# arithmetic: "12+7=" -> "19". Tiny-vocabulary, generated in code; arithmetic:DIGITS sets the difficulty.
# ---------------------------------------------------------------------------------------------------


def arithmetic_reward(prompt, completion, answer):
    """1 if the completion, stripped of surrounding whitespace, is exactly the answer ("19"), else 0.

    No partial credit: a near miss is still wrong, and nothing can be gained by a constant answer.
    """
    return float(completion.strip() == answer)


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
# countdown: reach a target from 3-4 numbers with + - * / (as in TinyZero). Generated in code.
# ---------------------------------------------------------------------------------------------------

COUNTDOWN_PROMPT = (
    "Using the numbers {numbers}, write an equation that equals {target}. You can use +, -, *, / and each "
    "number at most once. Give the equation inside <answer></answer>, for example <answer>(1 + 2) / 3</answer>."
)
COUNTDOWN_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def countdown_value(equation, numbers, max_chars=100):
    """The exact value (a Fraction) of `equation`, or None unless it is well formed.

    Well formed: at most `max_chars` characters of "0123456789+-*/() ", parsed by `ast` into nothing
    but + - * / on whole-number literals, each taken from `numbers` and used at most as often as it
    appears there, and no division by zero. A trailing "= ..." is ignored: "(1 + 2) * 3 = 9" counts as
    "(1 + 2) * 3". Model text is never eval'ed: the tree is walked here, with exact fractions.
    """
    equation = equation.split("=")[0].strip()
    if not equation or len(equation) > max_chars or not set(equation) <= set("0123456789+-*/() "):
        return None
    try:
        tree = ast.parse(equation, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    literals = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
        elif not (isinstance(node, ast.BinOp) or type(node) in COUNTDOWN_OPS):
            return None  # anything else: unary minus, **, //, %, names, calls, ...
    if Counter(literals) - Counter(numbers):
        return None  # a number not in the list, or used more often than it is given

    def value(node):
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        return COUNTDOWN_OPS[type(node.op)](value(node.left), value(node.right))

    try:
        return value(tree)
    except ZeroDivisionError:
        return None


def countdown_reward(prompt, completion, answer):
    """1 if the last <answer>...</answer> holds an equation equal to the target, 0.1 if it holds a
    well-formed one (countdown_value) that misses, 0 otherwise (no tags, or anything else in them).

    `answer` is JSON: {"target": 24, "numbers": [3, 7, 25, 50]}.
    """
    spec = json.loads(answer)
    # Searched from the end, in linear time: a lazy regex rescans the rest of the text from every
    # unclosed "<answer>": 25 s on a 160,000-character degenerate completion.
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return 0.0
    value = countdown_value(completion[start + len("<answer>") : end], spec["numbers"])
    if value is None:
        return 0.0
    return 1.0 if value == spec["target"] else 0.1


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
    return Task("countdown", *split_examples("countdown", examples, seed), countdown_reward)


# ---------------------------------------------------------------------------------------------------
# gsm8k: grade-school math word problems (Cobbe et al. 2021), from the hub through `datasets`.
# ---------------------------------------------------------------------------------------------------

GSM8K_PROMPT = "{question}\nSolve it step by step, then write the final answer as a number after ####."
GSM8K_FORMAT_BONUS = 0.1


def gsm8k_final_number(completion):
    """The number a completion ends on, as written ("1,000"), or None. In order of preference: the
    first number after the last "####", the number in the last \\boxed{...}, the last number in the text."""
    _, hashes, after = completion.rpartition("####")
    if hashes and (match := NUMBER.search(after)):
        return match.group()
    boxed = re.findall(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", completion)  # one level of nested braces
    if boxed and (match := NUMBER.search(boxed[-1])):
        return match.group()
    found = NUMBER.findall(completion)
    return found[-1] if found else None


def gsm8k_reward(prompt, completion, answer):
    """1 if the completion's final number (gsm8k_final_number) equals the answer, else 0.

    Compared as exact numbers, so "1,000", "$1000" and "1000.00" all match an answer of 1000.
    """
    final = gsm8k_final_number(completion)
    return float(final is not None and parse_number(final) == parse_number(answer))


def gsm8k_format_reward(prompt, completion, answer):
    """gsm8k_reward, plus GSM8K_FORMAT_BONUS (0.1) when a number follows "####", capped at 1.

    So a right answer gets 1 in any format, and a wrong one 0.1 in the asked-for format, 0 otherwise.
    """
    uses_format = re.search(r"####\s*\$?-?\d", completion) is not None
    return min(1.0, gsm8k_reward(prompt, completion, answer) + GSM8K_FORMAT_BONUS * uses_format)


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
# jsonl:PATH and python:FILE.py:FUNCTION: your own data, your own reward function.
# ---------------------------------------------------------------------------------------------------


def match_reward(prompt, completion, answer):
    """1 if the completion, stripped, is the answer, or both read as the same number ("3.50" and "3.5",
    "1,000" and "1000"; see parse_number); else 0."""
    completion, answer = completion.strip(), answer.strip()
    if completion == answer:
        return 1.0
    number = parse_number(answer)
    return float(number is not None and parse_number(completion) == number)


def jsonl_task(path):
    """Your examples, one {"prompt": ..., "answer": ...} a line, scored by match_reward; 10% held out."""
    name = f"jsonl:{path}"
    return Task(name, *split_examples(name, read_jsonl(path)), match_reward)


def import_file(path):
    """Import a Python file as a module, turning any error it raises into a UsageError."""
    module_name = "user_task_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickle look modules up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise UsageError(f"importing {path} raised {type(e).__name__}: {e}: fix that file") from None
    return module


def python_task(spec):
    """`FILE.py:FUNCTION` or `FILE.py:FUNCTION@DATA.jsonl`: the reward FUNCTION(prompt, completion, answer)
    of your file, on the examples of its module-level EXAMPLES list, or of DATA.jsonl when given.

    A reward function that raises or returns anything but a finite number stops the run with a message
    naming the prompt and completion (Task.score).
    """
    usage = "write python:FILE.py:FUNCTION or python:FILE.py:FUNCTION@DATA.jsonl"
    target, _, data = spec.partition("@")
    path, _, function = target.rpartition(":")
    if not path.endswith(".py") or not function.isidentifier():
        raise UsageError(f"task python:{spec}: {usage}")
    if not os.path.isfile(path):
        raise UsageError(f"task python:{spec}: there is no file {path!r}; check the path ({usage})")
    module = import_file(path)
    if not hasattr(module, function):
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise UsageError(f"{path} has no {function!r}; its functions are: {', '.join(defined) or 'none'}")
    reward_fn = getattr(module, function)
    if not callable(reward_fn):
        raise UsageError(f"{path}: {function} is a {type(reward_fn).__name__}, not a function")
    try:
        inspect.signature(reward_fn).bind("prompt", "completion", "answer")
    except TypeError:
        raise UsageError(f"{path}: {function} must take three arguments: (prompt, completion, answer)") from None
    except ValueError:  # some builtins have no signature to check; Task.score will catch a bad call
        pass
    if data:
        examples = read_jsonl(data)
    elif isinstance(getattr(module, "EXAMPLES", None), (list, tuple)):
        examples = [check_example(row, f"{path}, EXAMPLES[{i}]") for i, row in enumerate(module.EXAMPLES)]
    else:
        raise UsageError(
            f'{path} has no EXAMPLES list: define EXAMPLES = [{{"prompt": "...", "answer": "..."}}, ...] '
            f"in it, or pass the examples as python:{target}@DATA.jsonl"
        )
    name = f"python:{spec}"
    return Task(name, *split_examples(name, examples), reward_fn)


# ---------------------------------------------------------------------------------------------------
# Task names.
# ---------------------------------------------------------------------------------------------------

TASKS = {
    "copy": copy_task,
    "arithmetic": arithmetic_task,
    "countdown": countdown_task,
    "gsm8k": gsm8k_task,
    "gsm8k:format": lambda: gsm8k_task(format_bonus=True),
}

# Tasks written NAME:ARGUMENT, by NAME: how the form is written, and the function that takes ARGUMENT.
TASK_FORMS = {
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
