"""Seed hand-written bugs into the code, one at a time, and check that the fast suite (`pytest -m "not slow"`,
what a person runs after each edit) catches each one. Run it before resolving an issue that touches grpo.py,
ppo.py or the files they use; it is not part of the normal suite (tests/conftest.py ignores this folder).

    python tests/mutants/run.py                      # every mutant against the fast suite
    python tests/mutants/run.py --only grpo-old-logp-attached tasks-sampler-state-alias
    python tests/mutants/run.py --own                # each mutant against its own selection only (slow tests too)
    python tests/mutants/run.py --list               # names, files and what each breaks
    python tests/mutants/run.py --mutants other.py   # another list in the same format (a fresh pass)
    python tests/mutants/run.py --rev HEAD           # the committed code, whatever is being edited

The repository's working tree (or, with --rev, a git revision) is copied to a temporary folder (the checkout
is never touched); each mutant replaces one exact snippet of one file there and the tests run with a timeout:
first the mutant's own selection (its `tests`, fast tests only), where it should die in seconds, then, if it
lived, the rest of the fast suite; the file is put back. First the unmutated copy must pass what the mutants
run (a failing test would make every mutant look killed), or the run stops.

Not a kill: a snippet that is not in the file exactly once (the code moved on: update the mutant in mutants.py;
tests/test_mutant_list.py fails on it in the normal suite too), and a run that timed out (TIMEOUT: raise
--timeout or make the test faster).

Exit status: 0 when every mutant is killed, 1 when one survives, 2 when one could not be applied, timed out
or errored (the runner did not do its job).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP = shutil.ignore_patterns(".git", "runs", "__pycache__", ".pytest_cache", ".venv", "venv", ".benchmarks", "*.pyc")


# The fast suite, less the check of the mutant list itself: a mutated file no longer holds its mutant's snippet,
# so that check would "kill" every mutant.
FAST = ["-m", "not slow", "--deselect", "tests/test_mutant_list.py"]


def run_pytest(repo, selection, timeout):
    """(pytest's exit code or "timeout", seconds, first failing test or error line) of `pytest -x -q selection`."""
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *selection]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    try:
        out = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, f"no result in {timeout} s"
    lines = (out.stdout + out.stderr).splitlines()
    first = next((line for line in lines if line.startswith(("FAILED", "ERROR"))), lines[-1] if lines else "")
    return out.returncode, time.monotonic() - start, first[:150]


def status_of(returncode):
    """pytest's exit codes: 1 tests failed, 2 interrupted (a collection error: the mutant broke an import),
    3 internal error, 4 usage error (a bad selection), 5 no tests collected (only after the rest of the suite)."""
    if returncode == "timeout":
        return "TIMEOUT"
    return {0: "SURVIVED", 1: "killed", 2: "killed (collection error)"}.get(
        returncode, f"ERROR (pytest exit {returncode})"
    )


def whole_files(selection):
    """The test files a selection runs in full (no -k, no ::node), which the rest of the fast suite can skip."""
    if "-k" in selection:
        return []
    return [arg for arg in selection if arg.endswith(".py") and "::" not in arg]


class BaselineFails(Exception):
    """The unmutated copy fails a selection: every mutant would look killed there."""


def run_mutant(repo, tests, timeout, own, unmutated_passes):
    """(status, seconds, caught by): its own selection, then (fast mode, when it lived) the rest of the fast suite.
    `unmutated_passes(selection)` is checked first for each selection (the mutated file is restored meanwhile)."""
    own_selection = tuple(tests) if own else tuple(FAST + list(tests))
    unmutated_passes(own_selection)
    code, seconds, first = run_pytest(repo, own_selection, timeout)
    if own or code not in (0, 5):  # 5: its selection has no fast test
        return status_of(code), seconds, first
    rest = tuple(FAST + ["tests"] + [f"--ignore={path}" for path in whole_files(tests)])
    unmutated_passes(rest)
    code, more, first = run_pytest(repo, rest, max(1, timeout - seconds))
    return status_of(code), seconds + more, first


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per mutant (default 1200)")
    parser.add_argument("--own", action="store_true", help="run each mutant's own selection only, slow tests included")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of each selection")
    parser.add_argument(
        "--rev", metavar="REV", help="mutate this git revision (git archive) instead of the working tree"
    )
    parser.add_argument(
        "--mutants",
        metavar="FILE.py",
        help="a file defining MUTANTS in the same format (default: the copy's tests/mutants/mutants.py)",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        repo = os.path.join(tmp, "repo")
        if args.rev:
            os.makedirs(repo)
            archive = subprocess.run(["git", "-C", ROOT, "archive", args.rev], capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", repo], input=archive, check=True)
        else:
            shutil.copytree(ROOT, repo, ignore=SKIP)
        # By default the list of the copied snapshot, so its snippets are those of the code it mutates.
        path = args.mutants or os.path.join(repo, "tests", "mutants", "mutants.py")
        namespace = {}
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), namespace)
        names = [m["name"] for m in namespace["MUTANTS"]]
        assert len(set(names)) == len(names), "mutant names must be unique"
        mutants = [m for m in namespace["MUTANTS"] if not args.only or m["name"] in args.only]
        if args.only and len(mutants) != len(set(args.only)):
            sys.exit(f"unknown mutant(s): {', '.join(sorted(set(args.only) - set(names)))}")
        if args.list:
            for m in mutants:
                print(f"{m['name']:<40} {m['file']:<15} {m['what']}")
            return 0
        print(f"copied {ROOT} ({args.rev or 'working tree'}) to {repo}; {len(mutants)} mutants from {path}", flush=True)

        checked = set()  # the selections the unmutated copy passed

        def unmutated_passes(selection):
            if args.no_baseline or selection in checked:
                return
            with open(path, "w", encoding="utf-8") as f:
                f.write(original)
            code, seconds, first = run_pytest(repo, selection, args.timeout)
            print(
                f"baseline {' '.join(selection)}: {'FAILS' if code not in (0, 5) else 'passes'} ({seconds:.0f} s)",
                flush=True,
            )
            if code not in (0, 5):
                raise BaselineFails(first)
            checked.add(selection)
            with open(path, "w", encoding="utf-8") as f:
                f.write(original.replace(m["find"], m["replace"]))

        rows = []
        for m in mutants:
            path = os.path.join(repo, m["file"])
            with open(path, encoding="utf-8") as f:
                original = f.read()
            count = original.count(m["find"])
            if count != 1:
                status = "NOT FOUND" if count == 0 else f"AMBIGUOUS ({count} matches)"
                rows.append((m, status, 0.0, "the snippet must occur exactly once: update tests/mutants/mutants.py"))
                print(f"!!! {m['name']}: {status} in {m['file']}", flush=True)
                continue
            try:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(original.replace(m["find"], m["replace"]))
                status, seconds, first = run_mutant(repo, m["tests"], args.timeout, args.own, unmutated_passes)
            except BaselineFails as e:
                print(f"  {e}\nthe unmutated code fails this selection: fix it before counting mutants", flush=True)
                return 2
            finally:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(original)
            rows.append((m, status, seconds, first))
            print(f"{m['name']}: {status} ({seconds:.0f} s)", flush=True)

    print()
    print(f"{'mutant':<40} {'file':<15} {'result':<26} {'s':>4}  caught by / note")
    for m, status, seconds, first in rows:
        note = m["what"] if status == "SURVIVED" else first
        print(f"{m['name']:<40} {m['file']:<15} {status:<26} {seconds:>4.0f}  {note}")
    applicable = [r for r in rows if r[1].startswith(("killed", "SURVIVED"))]
    killed = [r for r in applicable if r[1].startswith("killed")]
    broken = [r for r in rows if r not in applicable]
    print()
    total = sum(r[2] for r in rows)
    print(f"kill rate: {len(killed)}/{len(applicable)} applicable mutants killed ({total:.0f} s of tests)")
    if broken:
        print(f"RUNNER FAILURE (not found, ambiguous, timeout or error): {', '.join(r[0]['name'] for r in broken)}")
    survivors = [r[0]["name"] for r in applicable if r[1] == "SURVIVED"]
    if survivors:
        print(f"SURVIVED: {', '.join(survivors)}")
    return 2 if broken else 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
