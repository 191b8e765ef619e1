"""Every mutant of tests/mutants/mutants.py still applies: its snippet occurs exactly once in its file, and the
test files it names exist. A fork that rewrites a line sees the mutant named here, not a silent NOT FOUND."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mutants():
    namespace = {}
    path = os.path.join(ROOT, "tests", "mutants", "mutants.py")
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), namespace)
    return namespace["MUTANTS"]


def test_mutant_names_are_unique():
    names = [m["name"] for m in mutants()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("mutant", mutants(), ids=lambda m: m["name"])
def test_each_mutant_applies_once(mutant):
    with open(os.path.join(ROOT, mutant["file"]), encoding="utf-8") as f:
        count = f.read().count(mutant["find"])
    assert count == 1, (
        f"mutant {mutant['name']}: its snippet occurs {count} times in {mutant['file']}: "
        "update `find` (and `replace`) in tests/mutants/mutants.py to the code as it is now"
    )
    files = [arg.split("::")[0] for arg in mutant["tests"] if arg.endswith(".py") or "::" in arg]
    assert files and all(os.path.isfile(os.path.join(ROOT, f)) for f in files), mutant["tests"]
