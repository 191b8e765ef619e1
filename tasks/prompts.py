"""A task of prompts alone, for RLHF against a reward model (--reward-model): a JSONL file of lines without an
"answer", each a prompt as a string or as a chat's one user message, in the forms TRL and OpenRLHF read:

    {"prompt": "Write one short sentence about a quiet river."}
    {"prompt": [{"role": "user", "content": "Write one short sentence about a quiet river."}]}
    {"messages": [{"role": "user", "content": "Write one short sentence about a quiet river."}]}

Each becomes the example {"prompt": its text, "answer": ""} (the policy's chat template renders it as the user's
turn, as every prompt). A file whose lines all have an "answer" is an ordinary jsonl task (tasks/user.py reads it);
one that mixes the two is refused, naming a line of each kind. Other fields are kept (user.other_fields).
"""

from machinery.errors import UsageError, shorten
from tasks.user import EXAMPLE_FORM, check_example, check_text, other_fields, read_jsonl

PROMPT_FORM = '{"prompt": "..."}'


def prompt_text(value, key, where):
    """The prompt of a line: a non-empty string, or a list of one {"role": "user", "content": str} message."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        message = value[0]
        if message.get("role") != "user" or not isinstance(message.get("content"), str):
            raise UsageError(
                f'{where}: "{key}"[0] must be {{"role": "user", "content": "..."}}, not {shorten(message)}'
            )
        value = message["content"]
    elif isinstance(value, list):
        raise UsageError(
            f'{where}: "{key}" holds {len(value)} messages: a prompt here is one user message (pass a system turn '
            "with --system-prompt)"
        )
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f'{where}: "{key}" must be a non-empty string or one user message, not {shorten(value)}')
    check_text(value, key, where)
    return value


def check_row(row, where):
    """(example, where, alone): a line with an "answer" checked as user.check_example does (alone False), one
    without as a prompt alone (its "prompt", or its "messages"; alone True)."""
    if not isinstance(row, dict) or "answer" in row:
        return check_example(row, where), where, False
    key = "prompt" if "prompt" in row else "messages" if "messages" in row else None
    if key is None:
        raise UsageError(
            f'{where}: the key "prompt" is missing; write {PROMPT_FORM} (prompts alone, with --reward-model) or '
            f"{EXAMPLE_FORM}"
        )
    return (
        {**other_fields(row, ("prompt", "messages")), "prompt": prompt_text(row[key], key, where), "answer": ""},
        where,
        True,
    )


def read_examples(path):
    """(examples, prompts_only): the lines of a JSONL file, all with an answer or all without (prompts_only)."""
    rows = read_jsonl(path, check_row, f"{PROMPT_FORM} or {EXAMPLE_FORM}")
    alone = [where for _, where, without in rows if without]
    if alone and len(alone) < len(rows):
        answered = next(where for _, where, without in rows if not without)
        raise UsageError(
            f'{alone[0]} has no "answer" while {answered.rpartition(", ")[2]} has one: give every line an "answer", '
            "or none (prompts alone, with --reward-model)"
        )
    return [example for example, _, _ in rows], bool(alone)


def read_prompts_or_examples(path):
    """The examples of a file of prompts alone (answer "") or of prompts and answers: what a python:FILE.py:FUNCTION
    task reads from its @DATA.jsonl, whose reward function takes `answer` either way."""
    return read_examples(path)[0]
