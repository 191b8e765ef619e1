"""grpo.py (or ppo.py) with each choice of threads, alone and beside one busy process, side by side.

    python benchmarks/threads.py                                  # tiny model, --num-steps 100, 3 repeats
    python benchmarks/threads.py --script ppo --num-steps 50
    python benchmarks/threads.py --repeats 1 -- --model PATH --max-new-tokens 16 --num-steps 3   # any model

Each run is the whole command (`python grpo.py --num-steps 100 --sample-every 0`, start-up included) in its own
process, timed by the wall clock; the choices and the two conditions are interleaved, each repeated, and the
table gives the median. The choices (machinery/threads.py):

    auto            the default: torch's number of threads, waiting threads sleep (OMP_WAIT_POLICY=PASSIVE)
    one thread      --threads 1
    torch, spinning torch's number of threads, waiting threads spin: what a run did before threads.py
                    (GOMP_SPINCOUNT=300000, GNU OpenMP's own default, keeps threads.py from setting a policy)
    idle, spinning  waiting threads spin, and --threads auto picks the cores idle at start (/proc/stat)

"Busy" runs beside `python -c "while True: pass"`, started before the run and stopped after it. A run that
takes longer than --timeout is stopped and shown as "> timeout". On a machine shared with other jobs "alone" is
not alone: each figure is quoted with the load average at its start and with `others`, the cores that other
processes (neither the run nor the busy process) kept busy during it, from /proc/stat.
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
SPIN = {"GOMP_SPINCOUNT": "300000"}  # GNU OpenMP's spin count when no wait policy is set: what torch did before
CHOICES = {  # name: (environment, flags)
    "auto": ({}, []),
    "one thread": ({}, ["--threads", "1"]),
    "torch, spinning": (SPIN, ["--threads", "TORCH_DEFAULT"]),
    "idle, spinning": (SPIN, []),
}
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


def one_run(choice, busy, a):
    """{seconds, load, others, threads} of one run of the script with `choice`, beside a busy process or not."""
    env_add, flags = CHOICES[choice]
    flags = [a.torch_default if flag == "TORCH_DEFAULT" else flag for flag in flags]
    env = {**CLEAN, **env_add, "PYTHONUNBUFFERED": "1"}  # a run stopped at the timeout has printed its threads
    cmd = [sys.executable, f"{a.script}.py", "--num-steps", str(a.num_steps), "--sample-every", "0"]
    cmd += ["--output-dir", a.output_dir, *flags, *a.extra]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if spinner:
            time.sleep(0.5)  # the busy process is running before the run starts, as a pip install would be
        load, jiffies, ours, start = os.getloadavg()[0], busy_jiffies(), children_seconds(), time.perf_counter()
        spun = process_seconds(spinner.pid) if spinner else 0.0
        try:
            out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=a.timeout)
            seconds, stopped, stdout = time.perf_counter() - start, False, out.stdout
            if out.returncode != 0:
                sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
        except subprocess.TimeoutExpired as e:  # what it printed so far comes as bytes
            seconds, stopped, stdout = a.timeout, True, (e.stdout or b"").decode(errors="replace")
        threads = re.search(r"^threads: (\d+)", stdout, re.M)
        threads = threads.group(1) if threads else "?"
        spun = process_seconds(spinner.pid) - spun if spinner else 0.0
        others = (busy_jiffies() - jiffies - (children_seconds() - ours) - spun) / seconds
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    return dict(seconds=seconds, stopped=stopped, load=load, others=max(0.0, others), threads=threads)


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
    parser.add_argument("--choices", nargs="*", default=list(CHOICES), choices=list(CHOICES))
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

    runs = {(choice, busy): [] for choice in a.choices for busy in (False, True)}
    for repeat in range(a.repeats):
        for choice in a.choices:
            for busy in (False, True):
                r = one_run(choice, busy, a)
                runs[choice, busy].append(r)
                print(
                    f"repeat {repeat + 1}, {choice}, {'busy' if busy else 'alone'}: {r['seconds']:.1f} s, "
                    f"{r['threads']} threads, load {r['load']:.1f}, others {r['others']:.2f}",
                    flush=True,
                )

    best = min((summary(runs[c, False]) for c in a.choices), key=lambda s: (s[1], s[0]))
    print(
        f"\n{a.script}.py --num-steps {a.num_steps} {' '.join(a.extra)}: median of {a.repeats}, seconds, "
        f"{os.cpu_count()} cores\n"
    )
    print("| choice | threads (alone, busy) | alone | beside one busy process | busy / alone | alone / best alone |")
    print("|---|---|---|---|---|---|")
    for c in a.choices:
        alone, busy = runs[c, False], runs[c, True]
        threads = f"{'/'.join(sorted({r['threads'] for r in alone}))}, {'/'.join(sorted({r['threads'] for r in busy}))}"
        print(
            f"| {c} | {threads} | {cell(alone)} | {cell(busy)} | {ratio(summary(busy), summary(alone))} "
            f"| {ratio(summary(alone), best)} |"
        )


if __name__ == "__main__":
    main()
