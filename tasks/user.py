"""Your own files, read and checked: JSONL examples (jsonl:PATH) and Python reward functions
(python:FILE.py:FUNCTION[@DATA.jsonl]). Every problem found is a UsageError naming the file, the line or
the function, and what to write instead. tasks/__init__.py turns what these return into tasks.
"""

import contextlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import stat
import sys
from decimal import Decimal

from machinery.errors import Interrupted, UsageError, one_line, shorten


def number_text(value, where):
    """A number as the plain decimal text the reward functions read; a UsageError if it is not a finite number.

    JSON numbers arrive as Decimal (read_jsonl), so the digits are kept as written: 4 -> "4", 4.0 -> "4.0",
    1e3 -> "1000", 0.1 -> "0.1" (never float's "1e+20" or a rounded 0.30000000000000004). At most 1000
    characters, as rewards.parse_number reads no longer number.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, Decimal)):
        raise UsageError(f'{where}: "answer" must be a string or a number, not {shorten(value)}')
    if isinstance(value, numbers.Integral):
        value = Decimal(int(value))
    elif not isinstance(value, Decimal):
        value = Decimal(repr(float(value)))
    if not value.is_finite():
        raise UsageError(f'{where}: "answer" is {value}: write a finite number, or a string')
    digits = max(len(value.as_tuple().digits), abs(value.adjusted()) + 1)  # checked before writing out 1e999999999
    if digits > 1000:
        raise UsageError(
            f'{where}: "answer" is a number of about {digits} digits; rewards compare numbers of up to 1000 '
            "characters: write it as a string to compare it as text"
        )
    return format(value, "f")


def check_text(text, key, where):
    """A UsageError if `text` cannot be written as UTF-8 (a lone surrogate such as "\\ud800" in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(
            f'{where}: "{key}" holds {text[e.start : e.end]!r}, half of a surrogate pair, which is not a character: '
            "remove it or write the whole character"
        ) from None


MAX_FIELD_DEPTH = 100  # lists and objects in a field nest at most this deep (Python's recursion stops near 1000)
MAX_INTEGER = 2**63  # an integer field's size: what a tensor (int64) holds; JSON's 5000 digits are not a number to us


def plain_numbers(value, key="", where="", depth=0):
    """A JSON value with its numbers as Python's own: an integer as int, any other number as float (read_jsonl
    reads them as Decimal, exactly, for the answer's digits); lists and objects converted throughout. A UsageError
    naming the field `key` at `where` for what a later step could not hold: a number that is not a finite float
    (1e400) or an int64, nesting past MAX_FIELD_DEPTH, text (or a key) that is not UTF-8 (a lone surrogate)."""
    if depth > MAX_FIELD_DEPTH:
        raise UsageError(f'{where}: field "{key}" nests deeper than {MAX_FIELD_DEPTH} levels: flatten it')
    if isinstance(value, Decimal):
        integer = value.as_tuple().exponent == 0
        if integer and abs(value) >= MAX_INTEGER or not integer and not math.isfinite(float(value)):
            kind = "an integer past 64 bits" if integer else "a number past float's range (it reads as inf)"
            raise UsageError(f'{where}: field "{key}" holds {kind}: write it as a string, or scale it')
        return int(value) if integer else float(value)  # 4 -> 4; 4.0, 1e3 -> 4.0, 1000.0
    if isinstance(value, str):
        check_text(value, key, where)
    if isinstance(value, list):
        return [plain_numbers(item, key, where, depth + 1) for item in value]
    if isinstance(value, dict):
        labels = {name: name.encode("utf-8", "backslashreplace").decode() for name in value}  # printable
        labels = {name: f"{key} > {label}" if key else label for name, label in labels.items()}
        for name in value:
            check_text(name, labels[name], where)
        return {name: plain_numbers(item, labels[name], where, depth + 1) for name, item in value.items()}
    return value


def other_fields(row, known, where=""):
    """The fields of a JSONL row besides `known`, kept for a variant of the algorithm to read (a `margin`, a
    `difficulty`): they reach the batch the loss receives (common.rollout) and the checkpoint's fingerprint of the
    data. Their numbers as int or float (plain_numbers), each field checked as plain_numbers says."""
    fields = {key: value for key, value in row.items() if key not in known}
    return plain_numbers(fields, "", where, -1)


def check_example(row, where):
    """`row` as {"prompt": str, "answer": str, ...its other fields}, or a UsageError saying what is wrong at `where`.

    A number as answer is accepted and turned into its plain decimal text (number_text):
    {"prompt": "2+2=", "answer": 4} gives the answer "4". Other fields are kept (other_fields).
    """
    if not isinstance(row, dict):
        raise UsageError(f'{where}: expected an object like {{"prompt": "...", "answer": "..."}}, not {shorten(row)}')
    for key in ("prompt", "answer"):
        if key not in row:
            raise UsageError(f'{where}: the key "{key}" is missing; every example needs "prompt" and "answer"')
    prompt, answer = row["prompt"], row["answer"]
    if not isinstance(prompt, str) or not prompt:
        raise UsageError(f'{where}: "prompt" must be a non-empty string, not {shorten(prompt)}')
    if not isinstance(answer, str):
        answer = number_text(answer, where)
    check_text(prompt, "prompt", where)
    check_text(answer, "answer", where)
    return {**other_fields(row, ("prompt", "answer"), where), "prompt": prompt, "answer": answer}


def refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number; write a finite number, or a string")


class DuplicateKey(ValueError):
    pass


def unique_keys(pairs):
    """An object's keys, each once: JSON readers differ on which of two values they keep, so neither is kept."""
    keys = [key for key, _ in pairs]
    for key in keys:
        if keys.count(key) > 1:
            raise DuplicateKey(key)
    return dict(pairs)


def parse_line(line):
    """One JSON line, its numbers read exactly as Decimal: no float rounding, no 4300-digit limit of int; a key
    given twice in one object is a DuplicateKey."""
    return json.loads(
        line, parse_float=Decimal, parse_int=Decimal, parse_constant=refuse_constant, object_pairs_hook=unique_keys
    )


MAX_JSONL_BYTES = 2**31  # 2 GiB of examples: read whole, then parsed line by line


def read_bytes(path):
    """The bytes of the regular file `path`: a named pipe (which would block open until a writer comes), a device
    (/dev/zero never ends) or a file past MAX_JSONL_BYTES is a UsageError, as a file that cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a pipe opens at once, without waiting for a writer
    except OSError as e:
        raise UsageError(f"cannot read {path!r} ({e.strerror}): check the path") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise UsageError(f"cannot read {path!r} (Is a directory): check the path")
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{path!r} is not a regular file (a pipe or a device): write the data to a file")
        if info.st_size > MAX_JSONL_BYTES:
            raise UsageError(f"{path!r} is {info.st_size / 2**30:.1f} GiB, more than the 2 GiB read: split it")
        chunks, size = [], 0
        while chunk := os.read(fd, 2**24):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_JSONL_BYTES:  # it grew while being read
                raise UsageError(f"{path!r} is more than the 2 GiB read: split it")
        return b"".join(chunks)
    except OSError as e:
        raise UsageError(f"cannot read {path!r} ({e.strerror}): check the path") from None
    finally:
        os.close(fd)


EXAMPLE_FORM = '{"prompt": "...", "answer": "..."}'


def read_jsonl(path, check=check_example, form=EXAMPLE_FORM):
    """The examples of a JSONL file, one {"prompt": ..., "answer": ...} object a line (or another `form`, each row
    checked by `check(row, where)`); blank lines are skipped.

    Whatever Python cannot read (a line that is not UTF-8, NaN, nesting too deep to parse) is a UsageError
    naming the line.
    """
    lines = read_bytes(path).split(b"\n")
    examples = []
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8").removeprefix("\ufeff" if number == 1 else "")  # the BOM some editors write
        except UnicodeDecodeError as e:
            byte = raw[e.start : e.start + 1]
            raise UsageError(
                f"{path}, line {number}: byte {byte!r} is not UTF-8 text: save the file as UTF-8 JSONL"
            ) from None
        if not line.strip():
            continue
        try:
            row = parse_line(line)
        except DuplicateKey as e:
            raise UsageError(
                f"{path}, line {number}: the key {shorten(e.args[0], 60)} is given twice in one object: keep one"
            ) from None
        except json.JSONDecodeError as e:
            reason = e.msg
        except ValueError as e:
            reason = str(e)
        except RecursionError:
            reason = "nested too deeply for Python to read"
        else:
            examples.append(check(row, f"{path}, line {number}"))
            continue
        raise UsageError(f"{path}, line {number}: not valid JSON ({reason}); write one object like {form} per line")
    if not examples:
        raise UsageError(f"{path} is empty: write one {form} object per line")
    return examples


@contextlib.contextmanager
def as_user_code():
    """Run your code as if on its own: it sees no command-line flags in sys.argv (an argparse at import would read
    ours), and the working directory it may change is put back after."""
    argv, cwd = sys.argv, os.getcwd()
    sys.argv = argv[:1]
    try:
        yield
    finally:
        sys.argv = argv
        os.chdir(cwd)


def import_file(path):
    """Import a Python file as a module, turning anything it raises (SystemExit included) into a UsageError."""
    module_name = "user_task_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickle look modules up here
    try:
        with as_user_code():
            spec.loader.exec_module(module)
    except Interrupted:  # a real Ctrl-C while it ran
        raise
    except BaseException as e:
        raise UsageError(f"importing {path} raised {type(e).__name__}: {one_line(e)}: fix that file") from None
    return module


def python_reward_and_examples(spec, read=read_jsonl):
    """(reward_fn, examples) of `FILE.py:FUNCTION` or `FILE.py:FUNCTION@DATA.jsonl`: the reward
    FUNCTION(prompt, completion, answer) of your file, and the examples of its module-level EXAMPLES list,
    or of DATA.jsonl when given, read by `read` (tasks.prompts: prompts alone too).

    A reward function that raises or returns anything but a finite number stops the run with a message
    naming the prompt and completion (Task.score).
    """
    usage = "write python:FILE.py:FUNCTION or python:FILE.py:FUNCTION@DATA.jsonl"
    # FUNCTION is an identifier, so the first ":FUNCTION" after ".py" ends the file's name, which may hold @ or :.
    form = re.fullmatch(r"(?P<path>.+?\.py):(?P<function>[^\W\d]\w*)(?:@(?P<data>.+))?", spec)
    if form is None:
        raise UsageError(f"task python:{spec}: {usage} (the file's name ends in .py, the function is a Python name)")
    path, function, data = form["path"], form["function"], form["data"]
    target = f"{path}:{function}"
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
        signature = inspect.signature(reward_fn)
        dense = {"tokens": ["3"]} if "tokens" in signature.parameters else {}  # a per-token reward's fourth argument
        signature.bind("prompt", "completion", "answer", **dense)
    except TypeError:
        raise UsageError(
            f"{path}: {function} must take (prompt, completion, answer), and `tokens` as a fourth "
            "for a per-token reward: def reward(prompt, completion, answer, tokens)"
        ) from None
    except ValueError:  # some builtins have no signature to check; Task.score will catch a bad call
        pass
    if data:
        examples = read(data)
    elif isinstance(getattr(module, "EXAMPLES", None), (list, tuple)):
        examples = [check_example(row, f"{path}, EXAMPLES[{i}]") for i, row in enumerate(module.EXAMPLES)]
    else:
        raise UsageError(
            f'{path} has no EXAMPLES list: define EXAMPLES = [{{"prompt": "...", "answer": "..."}}, ...] '
            f"in it, or pass the examples as python:{target}@DATA.jsonl"
        )
    return reward_fn, examples
