"""The built-in reward functions: reward(prompt, completion, answer) -> float in [0, 1] (copy_dense_reward:
a dense reward, spans that sum to the outcome), each a small pure function with its rule in its docstring.
tasks/__init__.py pairs each with its prompts.

Model text is only ever parsed, never executed: numbers by a regular expression, countdown equations by `ast`.
"""

import ast
import json
import operator
import re
from collections import Counter
from fractions import Fraction


def copy_reward(prompt, completion, answer):
    """Share of characters in the right place, over the longer of answer and completion.

    A random completion gets about 0.1 per digit; only the exact copy followed by EOS gets 1.
    There is no credit for format alone, so no constant answer can trap the policy.
    """
    hits = sum(a == c for a, c in zip(answer, completion))
    return hits / max(len(answer), len(completion))


def graded_copy_reward(prompt, completion, answer):
    """copy_reward with partial credit, the synthetic preference task's gold reward (tasks/preferences.py): each
    place of the answer earns 1 - |a - c| / 9 for the digit c written where its digit a belongs (0 for anything
    else), over the longer of answer and completion. Random characters get about 0.1; only the exact copy gets 1.
    """
    digits = "0123456789"
    credit = sum(1 - abs(int(a) - int(c)) / 9 for a, c in zip(answer, completion) if a in digits and c in digits)
    return credit / max(len(answer), len(completion), 1)


def copy_dense_reward(prompt, completion, answer):
    """copy_reward credited causally: the character at i earns R(completion[:i+1]) - R(completion[:i]), R being
    copy_reward, on the token that writes it, as an (i, i + 1, value) span (potential-based shaping, Ng et al.
    1999: what each token changed, never revised by a later one).

    Within the answer's length a right character earns 1 / len(answer) and a wrong one nothing; past it, each
    character lowers the share of the right ones before it, and pays that on its own token (negative). The
    values sum to copy_reward, so PPO can be given the same total per character or at the end.
    """
    spans, hits, before = [], 0, 0.0
    for i, c in enumerate(completion):
        hits += i < len(answer) and c == answer[i]
        now = hits / max(len(answer), i + 1)
        if now != before:
            spans.append((i, i + 1, now - before))
        before = now
    return spans


def arithmetic_reward(prompt, completion, answer):
    """1 if the completion, stripped of surrounding whitespace, is exactly the answer ("19"), else 0.

    No partial credit: a near miss is still wrong, and nothing can be gained by a constant answer.
    """
    return float(completion.strip() == answer)


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


def match_reward(prompt, completion, answer):
    """1 if the completion, stripped, is the answer, or both read as the same number ("3.50" and "3.5",
    "1,000" and "1000"; see parse_number); else 0."""
    completion, answer = completion.strip(), answer.strip()
    if completion == answer:
        return 1.0
    number = parse_number(answer)
    return float(number is not None and parse_number(completion) == number)


def last_number_reward(prompt, completion, answer, max_chars=100):
    """1 if the last number in the completion is the answer and the completion has at most `max_chars`
    characters, else 0 ("47 + 28 = 75" and "75" score 1 for answer 75; "75 + 1 = 76" scores 0).

    A chat model may show its working, so only the last number counts: listing many numbers earns nothing,
    and a completion that goes on past the answer (the usual way to hide a guess among others) ends on
    another number. The length cap keeps long rambles from being rewarded.
    """
    numbers = NUMBER.findall(completion)
    return float(len(completion) <= max_chars and bool(numbers) and parse_number(numbers[-1]) == parse_number(answer))


# ---------------------------------------------------------------------------------------------------
# countdown: reach a target from 3-4 numbers with + - * /, the equation inside <answer></answer>.
# ---------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------
# gsm8k: the final number of the completion against the answer's.
# ---------------------------------------------------------------------------------------------------


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
