"""grpo.py (or ppo.py) with each choice of threads, alone and beside one busy process, side by side.

    python benchmarks/threads.py                                  # tiny model, --num-steps 100, 3 repeats
    python benchmarks/threads.py --conditions alone busy late     # and a busy process that starts mid-run
    python benchmarks/threads.py --script ppo --num-steps 50
    python benchmarks/threads.py --repeats 1 -- --model PATH --max-new-tokens 16   # more flags for the script

Each run is the whole command (`python grpo.py --num-steps 100 --sample-every 0`, start-up included) in its own
process, timed by the wall clock; the choices and the conditions are interleaved, each repeated, and the table
gives the median. The choices (machinery/threads.py):

    auto            the default, --threads auto: torch's number of threads, at most the cores other processes
                    leave idle, checked at start, after each step and before each forward pass
    one thread      --threads 1
    torch's default torch's number of threads, what a run took before --threads
    passive wait    torch's number, and OMP_WAIT_POLICY=PASSIVE: a waiting thread sleeps at once
    short spin      torch's number, and GOMP_SPINCOUNT=1000: a waiting thread spins ~1000 times, then sleeps
                    (GNU OpenMP's default is 300000)

The conditions: alone; busy, beside `python -c "while True: pass"` started half a second before the run and
stopped after it; late, the same process started --late seconds after the run has chosen its threads. A run
that takes longer than --timeout is stopped, and a median that only bounds the time from below is shown as
"> seconds". On a machine shared with other jobs "alone" is not alone: each figure is quoted with the load
average at its start and `others`, the cores that other processes (neither the run nor the busy one) kept busy
during it (/proc/stat).
"""

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHOICES = {  # name: (environment, flags); TORCH_DEFAULT: torch's own number of threads here
    "auto": ({}, []),
    "one thread": ({}, ["--threads", "1"]),
    "torch's default": ({}, ["--threads", "TORCH_DEFAULT"]),  # fixed: what a run took before --threads
    "passive wait": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", "TORCH_DEFAULT"]),
    "short spin": ({"GOMP_SPINCOUNT": "1000"}, ["--threads", "TORCH_DEFAULT"]),
}
CONDITIONS = ("alone", "busy", "late")
CLEARED = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "MKL_NUM_THREADS")
CLEAN = {k: v for k, v in os.environ.items() if k not in CLEARED}  # the runs' environment, before each choice's


def busy_jiffies():
    """The machine's busy CPU time so far, in seconds (all but idle and iowait)."""
    with open("/proc/stat") as f:
        times = [int(x) for x in f.readline().split()[1:]]
    return (sum(times) - times[3] - times[4]) / os.sysconf("SC_CLK_TCK")


def process_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def children_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(choice, condition, a):
    """{seconds, stopped, load, others, threads} of one run of the script with `choice` in `condition`."""
    env_add, flags = CHOICES[choice]
    flags = [a.torch_default if flag == "TORCH_DEFAULT" else flag for flag in flags]
    env = {**CLEAN, **env_add, "PYTHONUNBUFFERED": "1"}  # a run stopped at the timeout has printed its threads
    cmd = [sys.executable, f"{a.script}.py", "--num-steps", str(a.num_steps), "--sample-every", "0"]
    cmd += ["--output-dir", a.output_dir, *flags, *a.extra]
    spin = [sys.executable, "-c", "while True: pass"]
    spinner = subprocess.Popen(spin) if condition == "busy" else None
    try:
        if spinner:
            time.sleep(0.5)  # the busy process is running before the run starts, as a pip install would be
        load, jiffies, ours, start = os.getloadavg()[0], busy_jiffies(), children_seconds(), time.perf_counter()
        run = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        printed = ""
        if condition == "late":  # once the run has chosen its threads
            while not printed.startswith("threads: ") and run.poll() is None:
                printed = run.stdout.readline()
            time.sleep(a.late)
            spinner = subprocess.Popen(spin)
        try:
            stdout, stderr = run.communicate(timeout=max(1.0, a.timeout - (time.perf_counter() - start)))
            stdout = printed + stdout
            seconds, stopped = time.perf_counter() - start, False
            if run.returncode != 0:
                sys.exit(f"{' '.join(cmd)} failed:\n{stderr[-2000:]}")
        except subprocess.TimeoutExpired:
            run.kill()
            stdout = printed + run.communicate()[0]
            seconds, stopped = a.timeout, True
        spun = process_seconds(spinner.pid) if spinner else 0.0  # all of its time: it started with or during the run
        others = (busy_jiffies() - jiffies - (children_seconds() - ours) - spun) / seconds
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    threads = re.search(r"^threads: (\d+)", stdout, re.M)
    return dict(
        seconds=seconds,
        stopped=stopped,
        load=load,
        others=max(0.0, others),
        threads=threads.group(1) if threads else "?",
    )


def summary(runs):
    """(median seconds, whether it is only a lower bound: half the runs or more were stopped at the timeout)."""
    stopped = sum(r["stopped"] for r in runs)
    return statistics.median(r["seconds"] for r in runs), stopped >= len(runs) - len(runs) // 2


def cell(runs):
    seconds, lower = summary(runs)
    load = statistics.median(r["load"] for r in runs)
    others = statistics.median(r["others"] for r in runs)
    return f"{'> ' if lower else ''}{seconds:.1f} (load {load:.1f}, others {others:.2f})"


def ratio(a, b):
    """a / b of two summaries, '>' or '<' where one is a lower bound, '?' where both are."""
    (x, x_lower), (y, y_lower) = a, b
    if x_lower and y_lower:
        return "?"
    return f"{'>' if x_lower else '<' if y_lower else ''}{x / y:.2f}x"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--script", choices=("grpo", "ppo"), default="grpo")
    parser.add_argument("--num-steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each choice in each condition")
    parser.add_argument("--timeout", type=float, default=120, help="seconds after which a run is stopped")
    parser.add_argument(
        "--late", type=float, default=5, help="seconds after the run chose its threads the late busy process starts"
    )
    parser.add_argument("--choices", nargs="*", default=list(CHOICES), choices=list(CHOICES))
    parser.add_argument("--conditions", nargs="*", default=["alone", "busy"], choices=CONDITIONS)
    parser.add_argument("--output-dir", default=os.path.join("runs", "threads-benchmark"))
    parser.add_argument("extra", nargs="*", help="after --: more flags for the script")
    a = parser.parse_args()
    a.output_dir = os.path.abspath(a.output_dir)
    a.torch_default = subprocess.run(  # torch's own number of threads, in a process of the runs' environment
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=CLEAN,
        capture_output=True,
        text=True,
    ).stdout.strip()

    runs = {(choice, condition): [] for choice in a.choices for condition in a.conditions}
    for repeat in range(a.repeats):
        for choice in a.choices:
            for condition in a.conditions:
                r = one_run(choice, condition, a)
                runs[choice, condition].append(r)
                print(
                    f"repeat {repeat + 1}, {choice}, {condition}: {r['seconds']:.1f} s{' (stopped)' * r['stopped']}, "
                    f"{r['threads']} threads, load {r['load']:.1f}, others {r['others']:.2f}",
                    flush=True,
                )

    print(
        f"\n`{a.script}.py --num-steps {a.num_steps} --sample-every 0 {' '.join(a.extra)}`, seconds, median of "
        f"{a.repeats}, {os.cpu_count()} cores; in brackets: the load average at the start, the cores others kept busy\n"
    )
    shown = [c for c in a.conditions if c != "alone"]
    best = (
        min((summary(runs[c, "alone"]) for c in a.choices), key=lambda s: (s[1], s[0]))
        if "alone" in a.conditions
        else None
    )
    columns = ["choice", "threads"] + list(a.conditions)
    columns += [f"{c} / alone" for c in shown if best] + (["alone / best alone"] if best else [])
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for choice in a.choices:
        threads = " / ".join("".join(sorted({r["threads"] for r in runs[choice, c]})) for c in a.conditions)
        cells = [choice, threads] + [cell(runs[choice, c]) for c in a.conditions]
        if best:
            alone = summary(runs[choice, "alone"])
            cells += [ratio(summary(runs[choice, c]), alone) for c in shown] + [ratio(alone, best)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
