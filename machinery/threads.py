"""How many threads torch's CPU operations run on (--threads), and how a waiting thread waits: what `auto` picks
here, and why.

torch runs each CPU operation on a team of OpenMP threads, and by default a thread that finishes first spins,
burning its core, until the others finish. When another process holds one of the cores, every operation waits
for a thread that is not running: on 2 cores, beside one busy process, the tiny run took 11.7x its time alone
on torch's 2 threads, 1.07x on one thread. The fix is in two parts:

1. Imported before torch (the first import of grpo.py and ppo.py), this module sets OMP_WAIT_POLICY=PASSIVE:
   a waiting thread sleeps at once instead of spinning. OpenMP reads the variable once, when torch loads it
   (GNU libgomp of the pip wheels, the LLVM and Intel runtimes alike), so setting it later does nothing. A wait
   policy of your own (OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME in the environment) is left as it is.
2. The number of threads (resolve_threads, at the start of main): see choose_threads.
"""

import os
import re
import sys
import time

from machinery.errors import UsageError  # errors.py imports nothing: torch is not loaded yet

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # GNU, LLVM and Intel OpenMP read these
USERS = [f"{name}={os.environ[name]}" for name in WAIT_VARIABLES if name in os.environ]
if USERS:
    WAIT = "wait policy of the environment: " + ", ".join(USERS)
elif "torch" in sys.modules:  # too late: its OpenMP has read its settings
    WAIT = "waiting threads spin: torch was loaded before machinery.threads"
else:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    WAIT = "waiting threads sleep: OMP_WAIT_POLICY=PASSIVE"
SLEEPS = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" or "0" in (
    os.environ.get("GOMP_SPINCOUNT"),
    os.environ.get("KMP_BLOCKTIME"),
)
TORCH_DEFAULT = {}  # torch's own number of threads, read before this process first sets it


def choose_threads(flag, cores, default, idle, env, processes, sleeps):
    """(threads, reason) for --threads `flag` ("auto" or a number) in a process that may run on `cores` cores,
    where torch would use `default` threads, `idle` cores were idle at start (None: unknown), OMP_NUM_THREADS is
    `env` (None: unset), `processes` processes of this run share the machine (torchrun's LOCAL_WORLD_SIZE), and
    waiting threads sleep (`sleeps`) or spin.

    A number given to --threads wins, then OMP_NUM_THREADS (torchrun sets it to 1 for several processes), then
    auto: torch's default, at most this process's share of the cores (processes x threads <= cores); where waiting
    threads spin, also at most the cores idle at start, so that no thread waits for a core another process holds.
    """
    if flag != "auto":
        threads = int(flag) if re.fullmatch(r"[0-9]+", flag) else 0
        if not 1 <= threads <= 4 * cores:
            raise UsageError(
                f"--threads is {flag!r}: pass auto, or a number of threads from 1 to {4 * cores} "
                f"(this machine has {cores} cores)"
            )
        return threads, f"--threads {threads}" + oversubscribed(threads, cores, processes)
    if env is not None:
        first = env.split(",")[0].strip()  # OpenMP also takes a list, one count per nesting level
        if not re.fullmatch(r"[0-9]+", first) or int(first) < 1:
            raise UsageError(f"OMP_NUM_THREADS is {env!r}: set it to a number of threads of at least 1, or unset it")
        torchrun = " (torchrun sets 1 for several processes)" if processes > 1 and first == "1" else ""
        return int(first), f"OMP_NUM_THREADS={env} in the environment{torchrun}" + oversubscribed(
            int(first), cores, processes
        )
    threads = min(default, max(1, cores // processes))
    why = f"torch's default on {cores} cores" if processes == 1 else f"{cores} cores / {processes} processes"
    if not sleeps and idle is not None and round(idle) < threads:
        threads, why = max(1, round(idle)), f"{idle:.1f} of {cores} cores idle at start"
    return threads, f"auto: {why}"


def oversubscribed(threads, cores, processes):
    """A note where this run's threads outnumber the cores."""
    if processes * threads <= cores:
        return ""
    return f", {processes} processes x {threads} threads > {cores} cores" if processes > 1 else f" > {cores} cores"


def idle_cores(cores, seconds=0.2):
    """How many of the machine's cores were idle over the next `seconds` (Linux /proc/stat), or over the last
    minute where that file is missing (the load average); None where neither is known (Windows)."""
    try:
        before = _cpu_times()
        time.sleep(seconds)
        after = _cpu_times()
        total = sum(after) - sum(before)
        idle = (after[3] + after[4]) - (before[3] + before[4])  # idle + iowait
        return (os.cpu_count() or cores) * idle / total if total > 0 else None
    except OSError:
        try:
            return max(0.0, (os.cpu_count() or cores) - os.getloadavg()[0])
        except (OSError, AttributeError):  # AttributeError: no getloadavg (Windows)
            return None


def _cpu_times():
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def resolve_threads(flag):
    """Set torch's number of threads for --threads `flag`, printed with the reason (by the first process)."""
    import torch

    from machinery import distributed as dist

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = os.environ.get("OMP_NUM_THREADS")
    idle = idle_cores(cores) if flag == "auto" and env is None and not SLEEPS else None
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    TORCH_DEFAULT.setdefault("threads", torch.get_num_threads())
    threads, reason = choose_threads(flag, cores, TORCH_DEFAULT["threads"], idle, env, processes, SLEEPS)
    torch.set_num_threads(threads)
    if dist.is_main():
        print(f"threads: {threads} ({reason}; {WAIT if threads > 1 else 'one thread never waits'})")
    return threads
