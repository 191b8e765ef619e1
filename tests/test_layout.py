"""The layout the README promises: the top level holds the entry points only, every module is listed in the
README's import order, each imports only modules listed below it, and no module (benchmarks included) imports
itself back through a circle. Imports are read with `ast`, inside functions too."""

import ast
import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("machinery", "tasks", "verifier")


def readme_order():
    """The paths of the README's Layout block, top to bottom."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = text.split("\n## Layout\n", 1)[1].split("```\n", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def module_path(name):
    """The repository file a dotted module name is, or None (the standard library, a package installed)."""
    parts = name.split(".")
    for candidate in (os.path.join(*parts) + ".py", os.path.join(*parts, "__init__.py")):
        if os.path.isfile(os.path.join(ROOT, candidate)):
            return candidate.replace(os.sep, "/")
    return None


def imported_files(path, extra_roots=()):
    """The repository files the module at `path` imports; `extra_roots`: folders also on its sys.path (the
    benchmarks import each other by their bare names)."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [
                [f"{node.module}.{alias.name}", node.module] for alias in node.names
            ]  # a module, or a name in one
    found = set()
    for candidates in names:
        for name in candidates:
            target = module_path(name) or next(
                (f"{root}/{name}.py" for root in extra_roots if os.path.isfile(os.path.join(ROOT, root, f"{name}.py"))),
                None,
            )
            if target:
                found.add(target)
                break
    return found - {path, "machinery/__init__.py", "verifier/__init__.py"}  # the packages' docstrings import nothing


def modules():
    files = glob.glob(os.path.join(ROOT, "*.py")) + [
        p for package in PACKAGES for p in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True)
    ]
    paths = sorted(os.path.relpath(p, ROOT).replace(os.sep, "/") for p in files)
    return [p for p in paths if p not in ("machinery/__init__.py", "verifier/__init__.py")]


def test_the_top_level_holds_the_entry_points_only():
    top = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert len(top) <= 5 and set(top) <= {"grpo.py", "ppo.py", "common.py", "verify.py", "reward_model.py"}, top


def test_every_module_is_in_the_readme_order():
    order = readme_order()
    assert len(order) == len(set(order)), "a module listed twice"
    assert sorted(order) == modules(), (sorted(set(modules()) - set(order)), sorted(set(order) - set(modules())))


def test_each_module_imports_only_modules_below_it():
    order = readme_order()
    position = {path: i for i, path in enumerate(order)}
    upward = [
        f"{path} imports {target}, listed above it"
        for path in order
        for target in sorted(imported_files(path))
        if position.get(target, len(order)) <= position[path]
    ]
    assert not upward, "\n".join(upward)


def test_no_circle_among_modules_and_benchmarks():
    paths = modules() + sorted(
        os.path.relpath(p, ROOT).replace(os.sep, "/") for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
    )
    graph = {path: imported_files(path, extra_roots=("benchmarks",)) for path in paths}
    state, circles = {}, []

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for path in paths:
        if path not in state:
            visit(path, [path])
    assert not circles, circles


def test_the_import_reader_sees_imports_inside_functions_and_modules_named_by_from(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("import os\nfrom pkg.a import f\n")
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    assert imported_files("pkg/a.py") == {"pkg/b.py"}
    assert imported_files("pkg/b.py") == {"pkg/a.py"}


# A file a reader is sent to by name: `--help` of the four entry points and the docstrings at the top of the
# modules. Placeholders for the reader's own files are written in capitals (FILE.py) or listed here.
THE_READERS_OWN = {"my_adapter.py"}  # verify.py's example of an adapter you write
HELPED = ("grpo.py", "ppo.py", "reward_model.py", "verify.py")
# verifier/adapters/ name the peers' own files (verl/trainer/ppo/core_algos.py), in their repositories.
DOCUMENTED = sorted(
    path
    for pattern in ("*.py", "machinery/*.py", "tasks/*.py", "verifier/*.py", "benchmarks/*.py")
    for path in glob.glob(pattern, root_dir=ROOT)
)


def named_files(text):
    """The .py paths a text names: `tasks/__init__.py`, `grpo.py`; not the reader's own (FILE.py, my_adapter.py)."""
    names = set(re.findall(r"(?<![\w/.-])(\w[\w/.-]*\.py)\b", text))
    return {name for name in names if name not in THE_READERS_OWN and not name.rsplit("/", 1)[-1][:-3].isupper()}


def missing_files(names, folder=""):
    """The names that are no file at that path, from the repository's root or (a module naming its neighbour) from
    `folder`."""
    return sorted(n for n in names if not any(os.path.isfile(os.path.join(ROOT, f, n)) for f in ("", folder)))


def test_named_files_reads_paths_and_leaves_placeholders():
    text = "see tasks.py or machinery/models.py, python:FILE.py:FUNC, --against my_adapter.py, a .py file"
    assert named_files(text) == {"tasks.py", "machinery/models.py"}
    assert missing_files(named_files(text)) == ["tasks.py"]


@pytest.mark.parametrize("script", HELPED)
def test_every_file_the_help_names_exists(script):
    """`--help`, unwrapped (a wide terminal): every file it sends the reader to is at that path."""
    env = dict(os.environ, COLUMNS="10000")
    text = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    ).stdout
    assert script in text, text[-2000:]  # the help was printed
    assert not missing_files(named_files(text)), f"{script} --help names {missing_files(named_files(text))}"


def test_every_file_a_module_docstring_names_exists():
    missing = {}
    for path in DOCUMENTED:
        docstring = ast.get_docstring(ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())) or ""
        missing[path] = missing_files(named_files(docstring), os.path.dirname(path))
    assert not {path: names for path, names in missing.items() if names}
