"""Seed hand-written bugs into the algorithm files, one at a time, and check that the tests meant to catch
each one do. Run it before resolving an issue that touches grpo.py, ppo.py, common.py, bookkeeping.py or
tasks.py; it is not part of the normal suite (tests/conftest.py ignores this folder).

    python tests/mutants/run.py                      # every mutant, about 10 minutes on 2 cores
    python tests/mutants/run.py --only grpo-old-logp-attached tasks-sampler-state-alias
    python tests/mutants/run.py --list               # names, files and what each breaks
    python tests/mutants/run.py --mutants other.py   # another list in the same format (a fresh pass)
    python tests/mutants/run.py --rev HEAD           # the committed code, whatever is being edited

The repository's working tree (or, with --rev, a git revision) is copied to a temporary folder (the checkout
is never touched); each mutant replaces one exact snippet of one file there, runs `pytest -x -q` on its
selection with a timeout, and puts the file back. First every selection runs on the unmutated copy: a selection that fails there would make
its mutants look killed, so the run stops. A snippet that is not in the file (the code moved on) is
reported as NOT FOUND, never counted as killed: update the mutant in mutants.py.

Exit status: 0 when every mutant is killed, 1 when one survives, 2 when one could not be applied or run.
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


def run_pytest(repo, selection, timeout):
    """(status, seconds, first failing test or error line) of `pytest -x -q selection` in `repo`."""
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
    3 internal error, 4 usage error (a bad selection), 5 no tests collected."""
    if returncode == "timeout":
        return "killed (timeout)"
    return {0: "SURVIVED", 1: "killed", 2: "killed (collection error)"}.get(returncode, f"ERROR (pytest exit {returncode})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per pytest run (default 240)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of each selection")
    parser.add_argument("--rev", metavar="REV", help="mutate this git revision (git archive) instead of the working tree")
    parser.add_argument("--mutants", metavar="FILE.py",
                        help="a file defining MUTANTS in the same format (default: the copy's tests/mutants/mutants.py)")
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

        if not args.no_baseline:
            selections = list(dict.fromkeys(tuple(m["tests"]) for m in mutants))
            for selection in selections:
                code, seconds, first = run_pytest(repo, selection, args.timeout)
                print(f"baseline {' '.join(selection)}: {'passes' if code == 0 else 'FAILS'} ({seconds:.0f} s)", flush=True)
                if code != 0:
                    print(f"  {first}\nthe unmutated code fails this selection: fix it before counting mutants", flush=True)
                    return 2

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
                code, seconds, first = run_pytest(repo, m["tests"], args.timeout)
            finally:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(original)
            rows.append((m, status_of(code), seconds, first))
            print(f"{m['name']}: {status_of(code)} ({seconds:.0f} s)", flush=True)

    print()
    print(f"{'mutant':<40} {'file':<15} {'result':<26} {'s':>4}  caught by / note")
    for m, status, seconds, first in rows:
        note = first if status.startswith("killed") or status.startswith(("NOT", "AMBIG", "ERROR")) else m["what"]
        print(f"{m['name']:<40} {m['file']:<15} {status:<26} {seconds:>4.0f}  {note}")
    applicable = [r for r in rows if r[1].startswith(("killed", "SURVIVED"))]
    killed = [r for r in applicable if r[1].startswith("killed")]
    broken = [r for r in rows if r not in applicable]
    print()
    print(f"kill rate: {len(killed)}/{len(applicable)} applicable mutants killed")
    if broken:
        print(f"NOT APPLIED (not found, ambiguous or errors): {', '.join(r[0]['name'] for r in broken)}")
    survivors = [r[0]["name"] for r in applicable if r[1] == "SURVIVED"]
    if survivors:
        print(f"SURVIVED: {', '.join(survivors)}")
        return 1
    return 2 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
