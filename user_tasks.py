"""Your own files, read and checked: JSONL examples (jsonl:PATH) and Python reward functions
(python:FILE.py:FUNCTION[@DATA.jsonl]). Every problem found is a UsageError naming the file, the line or
the function, and what to write instead. tasks.py turns what these return into tasks.
"""

import contextlib
import importlib.util
import inspect
import json
import os
import re
import sys

from errors import Interrupted, UsageError, one_line, shorten


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


def python_reward_and_examples(spec):
    """(reward_fn, examples) of `FILE.py:FUNCTION` or `FILE.py:FUNCTION@DATA.jsonl`: the reward
    FUNCTION(prompt, completion, answer) of your file, and the examples of its module-level EXAMPLES list,
    or of DATA.jsonl when given.

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
    return reward_fn, examples
