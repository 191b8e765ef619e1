"""The figures the docs state about the shipped code, computed from it: the README's share of `diff grpo.py ppo.py`
(the whole files and their `main`) and docs/flags.md's table of every flag.

    python benchmarks/doc_figures.py            # prints each figure and each row the docs lack or get wrong
    python benchmarks/doc_figures.py --check    # the same, exit status 1 when the docs are behind the code
    python benchmarks/doc_figures.py --write    # rewrites the README's two figures and adds the missing rows

Run before a release. The fast tests check only what a fork cannot break by adding a flag: each row of the flag
table is a flag of the scripts with its default (no stale row, no wrong default), and the README's sentence reads.
A fork's new flag is documented by its --help; its share of lines is the fork's own, not the README's.
"""

import argparse
import dataclasses
import difflib
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The README's sentence on `diff grpo.py ppo.py`: its figure for the whole files, then for their `main`.
SHARE = re.compile(
    r"(PPO's reward\): )(\d+)(% of the two files' lines.*?the training loops \(`main`\) differ in )(\d+)", re.DOTALL
)
FLAGS_PAGE, FLAGS_HEADING = "docs/flags.md", "# Every flag"


def read(path):
    return open(os.path.join(ROOT, path), encoding="utf-8").read()


def changed_share(a_lines, b_lines):
    """The share of two texts' lines that `diff` marks changed (difflib's diff: within a point of GNU diff's)."""
    changed = [line for line in difflib.unified_diff(a_lines, b_lines, n=0, lineterm="") if line[:1] in "+-"]
    return (len(changed) - 2) / max(len(a_lines) + len(b_lines), 1)  # less the two file headers


def main_lines(lines):
    """The lines of `def main` (to the next line at the left margin that is not blank)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("def main("))
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ")), len(lines))
    return lines[start:end]


def shares(grpo_path="grpo.py", ppo_path="ppo.py"):
    """(whole files, their main): the shares of lines `diff` marks changed, in percent, rounded."""
    a, b = read(grpo_path).splitlines(), read(ppo_path).splitlines()
    return round(changed_share(a, b) * 100), round(changed_share(main_lines(a), main_lines(b)) * 100)


def readme_shares(text):
    """The README's two figures (whole files, main), as it states them."""
    found = SHARE.search(text)
    if not found:
        raise ValueError("README.md has no sentence 'PPO's reward): N% of the two files' lines ... `main` differ in M'")
    return int(found.group(2)), int(found.group(4))


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


def documented_flags(text):
    """{--flag: {"grpo": cell, "ppo": cell}} of the flag table."""
    rows = {}
    for cells in table_rows(text):
        rows[re.match(r"`(--[\w-]+)", cells[0]).group(1)] = dict(grpo=cells[1], ppo=cells[2])
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit status 1 when the docs are behind the code")
    parser.add_argument("--write", action="store_true", help="rewrite the figures and add the missing rows")
    options = parser.parse_args()
    readme, page = read("README.md"), read(FLAGS_PAGE)
    stated, measured = readme_shares(readme), shares()
    print(f"diff grpo.py ppo.py: {measured[0]}% of the lines, main {measured[1]}% (README: {stated[0]}%, {stated[1]}%)")
    code, meanings = code_flags(scripts())
    documented = documented_flags(page)
    problems = wrong_rows(documented, code) + missing_rows(documented, code)
    if stated != measured:
        problems.append(
            f"README.md states {stated[0]}% and {stated[1]}%: the code's are {measured[0]}% and {measured[1]}%"
        )
    print("\n".join(problems) or "the docs state the code's figures and every flag")
    if options.write:
        readme = SHARE.sub(lambda m: f"{m.group(1)}{measured[0]}{m.group(3)}{measured[1]}", readme)
        open(os.path.join(ROOT, "README.md"), "w", encoding="utf-8").write(readme)
        new = [f"| `{flag}` | {code[flag]['grpo']} | {code[flag]['ppo']} | {meanings[flag]} |" for flag in code]
        new = [row for row, flag in zip(new, code) if flag not in documented]
        if new:  # after the table's last row
            last = [line for line in page.split(f"\n{FLAGS_HEADING}\n", 1)[1].split("\n#", 1)[0].splitlines()]
            last = [line for line in last if line.startswith("|")][-1]
            page = page.replace(last + "\n", last + "\n" + "\n".join(new) + "\n", 1)
            open(os.path.join(ROOT, FLAGS_PAGE), "w", encoding="utf-8").write(page)
        print(f"wrote README.md's figures and {len(new)} new rows of {FLAGS_PAGE} (each meaning: its --help)")
    elif options.check and problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
