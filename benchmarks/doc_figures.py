"""The figures the docs state about the shipped code, computed from it: the lines GNU `diff grpo.py ppo.py` marks
(`diff grpo.py ppo.py | grep -c '^[<>]'`, of the two files' total, and the share of their `main`) and docs/flags.md's
tables of every flag (grpo.py's and ppo.py's, then reward_model.py's).

    python benchmarks/doc_figures.py            # prints each figure and each row the docs lack or get wrong
    python benchmarks/doc_figures.py --check    # the same, exit status 1 when the docs are behind the code
    python benchmarks/doc_figures.py --write    # rewrites the README's two figures and adds the missing rows

Run before a release. The fast tests check only what a fork cannot break by adding a flag: each row of the flag
table is a flag of the scripts with its default (no stale row, no wrong default), and the README's sentence reads.
A fork's new flag is documented by its --help; its share of lines is the fork's own, not the README's.
"""

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The README's sentence on `diff grpo.py ppo.py`: the lines it marks, of the two files' lines, that share in percent,
# then the share of their `main`.
SHARE = re.compile(
    r"(`diff grpo\.py ppo\.py`\s+marks\s+)(\d+)(\s+of\s+the\s+two\s+files'\s+)(\d+)(\s+lines\s+\()(\d+)"
    r"(%\).*?the\s+training\s+loops\s+\(`main`\)\s+differ\s+in\s+)(\d+)",
    re.DOTALL,
)
FLAGS_PAGE, FLAGS_HEADING = "docs/flags.md", "# Every flag"
RM_HEADING = "## reward_model.py"  # its own table: its flags are its own but for the run flags


def read(path):
    return open(os.path.join(ROOT, path), encoding="utf-8").read()


def marked_lines(a_lines, b_lines):
    """The lines GNU `diff` marks between two texts (`diff A B | grep -c '^[<>]'`): the text's own diff, not a copy."""
    with tempfile.TemporaryDirectory() as folder:
        paths = [os.path.join(folder, name) for name in ("a", "b")]
        for path, lines in zip(paths, (a_lines, b_lines)):
            open(path, "w", encoding="utf-8").write("".join(line + "\n" for line in lines))
        out = subprocess.run(["diff", *paths], capture_output=True, text=True).stdout
    return sum(line[:1] in "<>" for line in out.splitlines())


def changed_share(a_lines, b_lines):
    """The share of two texts' lines that GNU `diff` marks."""
    return marked_lines(a_lines, b_lines) / max(len(a_lines) + len(b_lines), 1)


def main_lines(lines):
    """The lines of `def main` (to the next line at the left margin that is not blank)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("def main("))
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ")), len(lines))
    return lines[start:end]


def shares(grpo_path="grpo.py", ppo_path="ppo.py"):
    """(lines `diff` marks, the two files' lines, that share in percent, the share of their main in percent)."""
    a, b = read(grpo_path).splitlines(), read(ppo_path).splitlines()
    marked = marked_lines(a, b)
    main = round(changed_share(main_lines(a), main_lines(b)) * 100)
    return marked, len(a) + len(b), round(100 * marked / (len(a) + len(b))), main


def readme_shares(text):
    """The README's four figures (lines marked, lines in all, percent, main's percent), as it states them."""
    found = SHARE.search(text)
    if not found:
        raise ValueError("README.md has no sentence '`diff grpo.py ppo.py` marks N of the two files' M lines (P%) ...'")
    return tuple(int(found.group(i)) for i in (2, 4, 6, 8))


def shown(value):
    """A default as the flag table writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if isinstance(value, str) else str(value)


def table_rows(text, heading=FLAGS_HEADING):
    """The rows of the first table under `heading` of a docs page: [cells], the header and separator left out."""
    section = ("\n" + text).split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def documented_flags(text, heading=FLAGS_HEADING, columns=("grpo", "ppo")):
    """{--flag: {"grpo": cell, "ppo": cell}} of the flag table (`columns`: the scripts of the table under `heading`)."""
    rows = {}
    for cells in table_rows(text, heading):
        rows[re.match(r"`(--[\w-]+)", cells[0]).group(1)] = dict(zip(columns, cells[1:]))
    return rows


def code_flags(scripts):
    """{--flag: {"grpo": default, "ppo": default}} of the scripts' Args ("-" where a script lacks it), with the
    HUB_DEFAULTS value as the table writes it, and {--flag: its meaning} from the first script that has it."""
    flags, meanings = {}, {}
    for name, module in scripts.items():
        for field in dataclasses.fields(module.Args):
            flag = "--" + field.name.replace("_", "-")
            value = shown(field.default)
            if field.name in module.HUB_DEFAULTS:
                value += f" (hub {shown(module.HUB_DEFAULTS[field.name])})"
            flags.setdefault(flag, {script: "-" for script in scripts})[name] = value
            meanings.setdefault(flag, field_docstring(module.Args, field.name))
    return flags, meanings


def field_docstring(cls, name):
    """The docstring under a dataclass field, as --help prints it (tyro reads the same)."""
    from tyro import _docstrings

    return " ".join((_docstrings.get_field_docstring(cls, name, ()) or "").split())


def wrong_rows(documented, code):
    """What the table says that the code contradicts: a row for no flag, or a default the code does not have."""
    lines = [f"docs/flags.md has a row {flag} that no script has" for flag in sorted(documented.keys() - code.keys())]
    lines += [
        f"docs/flags.md: {flag} says {documented[flag]}, the code {code[flag]}"
        for flag in sorted(documented.keys() & code.keys())
        if documented[flag] != code[flag]
    ]
    return lines


def missing_rows(documented, code):
    return [f"docs/flags.md lacks a row for {flag}: {code[flag]}" for flag in sorted(code.keys() - documented.keys())]


def scripts():
    import grpo
    import ppo

    return {"grpo": grpo, "ppo": ppo}


def tables():
    """Each table of docs/flags.md: its heading and the scripts whose defaults are its columns."""
    import reward_model

    return [(FLAGS_HEADING, scripts()), (RM_HEADING, {"reward_model": reward_model})]


def add_rows(page, heading, rows):
    """The page with `rows` after the last row of the table under `heading`."""
    last = [line for line in f"\n{page}".split(f"\n{heading}\n", 1)[1].split("\n#", 1)[0].splitlines()]
    last = [line for line in last if line.startswith("|")][-1]
    return page.replace(last + "\n", last + "\n" + "\n".join(rows) + "\n", 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit status 1 when the docs are behind the code")
    parser.add_argument("--write", action="store_true", help="rewrite the figures and add the missing rows")
    options = parser.parse_args()
    readme, page = read("README.md"), read(FLAGS_PAGE)
    stated, measured = readme_shares(readme), shares()
    print(f"diff grpo.py ppo.py marks {measured[0]} of {measured[1]} lines ({measured[2]}%), main {measured[3]}%")
    problems, new = [], {}
    for heading, modules in tables():
        code, meanings = code_flags(modules)
        documented = documented_flags(page, heading, tuple(modules))
        problems += wrong_rows(documented, code) + missing_rows(documented, code)
        cells = lambda flag: " | ".join(code[flag][name] for name in modules)  # noqa: B023
        new[heading] = [f"| `{flag}` | {cells(flag)} | {meanings[flag]} |" for flag in code if flag not in documented]
    if stated != measured:
        problems.append(
            f"README.md states {stated}: the code's are {measured} (marked, lines, percent, main's percent)"
        )
    print("\n".join(problems) or "the docs state the code's figures and every flag")
    if options.write:
        marked, total, share, main = measured
        readme = SHARE.sub(
            lambda m: "".join((m[1], str(marked), m[3], str(total), m[5], str(share), m[7], str(main))), readme
        )
        open(os.path.join(ROOT, "README.md"), "w", encoding="utf-8").write(readme)
        for heading, rows in new.items():
            page = add_rows(page, heading, rows) if rows else page
        open(os.path.join(ROOT, FLAGS_PAGE), "w", encoding="utf-8").write(page)
        count = sum(map(len, new.values()))
        print(f"wrote README.md's figures and {count} new rows of {FLAGS_PAGE} (each meaning: its --help)")
    elif options.check and problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
