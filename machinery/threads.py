"""How many threads torch's CPU operations run on (--threads): what `auto` picks here, and why; and the freed
memory kept for reuse (keep_freed_memory).

torch runs each CPU operation on a team of OpenMP threads, and a thread that finishes its share first spins,
burning its core, until the others finish (GNU OpenMP, that of the pip wheels, spins ~300,000 times before it
sleeps). So when another process holds one of the cores, every operation waits for a thread that is not running:
on 2 cores, beside one busy process, the tiny run took 11.7x its time alone on torch's 2 threads, 1.07x on one.

`auto` therefore runs on torch's default number of threads, at most the cores that other processes leave idle:
measured for 0.2 s at start, then again after each step and before each forward pass (at most once a second),
from the machine's busy time (/proc/stat) less this process's own. A busy process that starts or stops mid-run
moves the number within a second or so of forward passes; the number after each step is logged as perf/threads.
On several processes (torchrun) and under --threads N or OMP_NUM_THREADS the number is fixed. A step's last bits
can depend on the number of threads (the order of a long sum): for bit-identical reruns on a shared machine, fix
it.

Measured and set aside (benchmarks/threads.py): a passive wait policy (OMP_WAIT_POLICY=PASSIVE, read once when
torch loads) holds up beside a busy process but makes the tiny run alone 1.49x slower, since every operation then
wakes a sleeping thread; a short spin (GOMP_SPINCOUNT=1000) costs 1.14x alone and still 1.67x beside a busy
process. Either can still be set in the environment.
"""

import ctypes
import os
import re
import time

import torch

from machinery import distributed as dist
from machinery.errors import UsageError

TORCH_DEFAULT = {}  # torch's own number of threads, read before this process first sets it
FOLLOW = {}  # auto on one process: "cap" (the most threads) and "last" (the CPU times of the last check)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20  # blocks over this are always mapped afresh (glibc, 64-bit)
CHECK_EVERY = 1.0  # seconds between two checks of the idle cores: a shorter window reads /proc/stat's 10 ms ticks


def choose_threads(flag, cores, default, idle, env, processes):
    """(threads, reason) for --threads `flag` ("auto" or a number) in a process that may run on `cores` cores,
    where torch would use `default` threads, `idle` cores were idle at start (None: unknown), OMP_NUM_THREADS is
    `env` (None: unset) and `processes` processes of this run share the machine (torchrun's LOCAL_WORLD_SIZE).

    A number given to --threads wins, then OMP_NUM_THREADS (torchrun sets it to 1 for several processes), then
    auto: torch's default, at most this process's share of the cores (processes x threads <= cores) and at most
    the cores idle at start (rounded), so that no thread waits for a core another process holds; at least one.
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
        first = omp_num_threads(env, cores)
        torchrun = " (torchrun sets 1 for several processes)" if processes > 1 and first == 1 else ""
        return first, f"OMP_NUM_THREADS={env} in the environment{torchrun}" + oversubscribed(first, cores, processes)
    threads = min(default, max(1, cores // processes))
    why = f"torch's default on {cores} cores" if processes == 1 else f"{cores} cores / {processes} processes"
    if idle is not None and round(idle) < threads:
        return max(1, round(idle)), f"auto: {idle:.1f} of {cores} cores idle at start"
    return threads, f"auto: {why}" + (f", {idle:.1f} idle at start" if idle is not None else "")


def omp_num_threads(env, cores):
    """The number of threads OMP_NUM_THREADS `env` sets (its first count: OpenMP also takes a list, one count per
    nesting level, each bounded too), bounded as --threads is (1 to 4 x cores): torch's first parallel operation
    starts that many threads, and 100,000 of them take every process slot of the machine. A UsageError otherwise."""
    levels = [level.strip() for level in env.split(",")]  # a nested level can start as many threads as the first
    first = levels[0]
    if not all(re.fullmatch(r"[0-9]+", level) and 1 <= int(level) <= 4 * cores for level in levels):
        raise UsageError(
            f"OMP_NUM_THREADS is {env[:40]!r}: set it to a number of threads from 1 to {4 * cores} "
            f"(this machine has {cores} cores), or unset it"
        )
    return int(first)


# Thread counts our dependencies read from the environment, each starting that many threads: BLAS libraries (MKL,
# OpenBLAS, BLIS, Apple's Accelerate), numexpr, the tokenizers' pool (Rayon, under TOKENIZERS_PARALLELISM) and
# torch.compile's workers. RAYON_NUM_THREADS=100000 would take every process slot of the machine, as OMP's would.
THREAD_COUNTS = (
    "MKL_NUM_THREADS OPENBLAS_NUM_THREADS GOTO_NUM_THREADS BLIS_NUM_THREADS VECLIB_MAXIMUM_THREADS NUMEXPR_NUM_THREADS "
    "NUMEXPR_MAX_THREADS RAYON_NUM_THREADS RAYON_RS_NUM_CPUS TORCHINDUCTOR_COMPILE_THREADS".split()
)


def check_environment(environ=os.environ):
    """OMP_NUM_THREADS checked like --threads, and every other thread count of THREAD_COUNTS bounded the same way
    (1 to 4 x cores), before anything runs on threads (startup.start calls it first): one line each."""
    cores = usable_cores()
    if environ.get("OMP_NUM_THREADS") is not None:
        omp_num_threads(environ["OMP_NUM_THREADS"], cores)
    for name in THREAD_COUNTS:
        text = environ.get(name)
        if text is not None and not (re.fullmatch(r"[0-9]{1,6}", text.strip()) and 1 <= int(text) <= 4 * cores):
            raise UsageError(
                f"{name} is {text[:40]!r}: set it to a number of threads from 1 to {4 * cores} (this machine has "
                f"{cores} cores), or unset it"
            )


def usable_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_for_idle(cap, idle):
    """auto's number of threads when `idle` cores are left by other processes: at most `cap`, at least one."""
    return min(cap, max(1, round(idle)))


def oversubscribed(threads, cores, processes):
    """A note where this run's threads outnumber the cores."""
    if processes * threads <= cores:
        return ""
    return f", {processes} processes x {threads} threads > {cores} cores" if processes > 1 else f" > {cores} cores"


def cpu_times():
    """(wall seconds, the machine's busy CPU seconds, this process's CPU seconds); the machine's is None where
    /proc/stat is missing (not Linux)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # steal: a core the host took
    except (OSError, ValueError):
        busy = None
    own = os.times()
    return time.perf_counter(), busy, own.user + own.system


def idle_between(before, after):
    """The cores that processes other than this one left idle between two cpu_times(), on average; None where
    unknown."""
    (wall0, busy0, own0), (wall1, busy1, own1) = before, after
    if busy0 is None or busy1 is None or wall1 <= wall0:
        return None
    others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)
    return max(0.0, (os.cpu_count() or 1) - others)


def idle_cores(seconds=0.2):
    """The cores idle over the next `seconds` (Linux), or over the last minute where /proc/stat is missing (the
    load average); None where neither is known (Windows)."""
    before = cpu_times()
    time.sleep(seconds)
    idle = idle_between(before, cpu_times())
    if idle is None and hasattr(os, "getloadavg"):
        idle = max(0.0, (os.cpu_count() or 1) - os.getloadavg()[0])
    return idle


def resolve_threads(flag):
    """Set torch's number of threads for --threads `flag`, printed with the reason (by the first process)."""
    cores = usable_cores()
    env = os.environ.get("OMP_NUM_THREADS")
    processes = dist.launch_number("LOCAL_WORLD_SIZE", 1)
    idle = idle_cores() if flag == "auto" and env is None else None
    TORCH_DEFAULT.setdefault("threads", torch.get_num_threads())
    threads, reason = choose_threads(flag, cores, TORCH_DEFAULT["threads"], idle, env, processes)
    torch.set_num_threads(threads)
    FOLLOW.clear()
    last = cpu_times()
    if flag == "auto" and env is None and processes == 1 and last[1] is not None:  # /proc/stat: Linux only
        FOLLOW.update(cap=min(TORCH_DEFAULT["threads"], cores), last=last)
        reason += "; followed after each step, perf/threads"
    if dist.is_main():
        print(f"threads: {threads} ({reason})")
    return threads


def follow_idle_cores():
    """Under auto on one process: set the threads to the cores other processes left idle since the last check, at
    most once every CHECK_EVERY seconds. Called after each step, and before each forward pass of a model
    (follow_before_forward): a busy process that starts during a long step is seen within a second of forward
    passes. Returns the number of threads."""
    if FOLLOW and time.perf_counter() - FOLLOW["last"][0] >= CHECK_EVERY:
        now = cpu_times()
        idle = idle_between(FOLLOW["last"], now)
        FOLLOW["last"] = now
        if idle is not None and threads_for_idle(FOLLOW["cap"], idle) != torch.get_num_threads():
            torch.set_num_threads(threads_for_idle(FOLLOW["cap"], idle))
    return torch.get_num_threads()


def follow_before_forward(module, args):
    """A forward pre-hook of every loaded model (models.load_pretrained): follow_idle_cores, inputs unchanged."""
    follow_idle_cores()


def keep_freed_memory(model, device):
    """On a CPU, with a model that has a weight of over 32 MB, keep the memory freed during a step for the next one
    (glibc, Linux). glibc maps each block of over 32 MB afresh and unmaps it when freed, so such a weight's
    gradient, its bf16 copy and the logits over its vocabulary are faulted in again page by page every step, each
    fault zeroing its page. Here no block is mapped on its own and the heap is not trimmed: after a few steps, what
    a step frees the next reuses. Measured (docs/benchmarks.md): SmolLM2's bf16 GRPO step 7.4 -> 6.3 s, peak memory
    3.53 -> 3.61 GB (the process holds its peak until it ends); the tiny model, whose blocks glibc already reuses,
    1.2x slower with it, so left alone. Not on a GPU, whose run would hold every host copy made while loading, nor
    where the policy recomputes its activations to save memory (startup.load_policy): there the heap's growth took
    SmolLM2's 128-token peak from 2.9 to 4.2 and 4.3 GiB over three steps, against 3.6 and 3.6 without it.
    Returns whether it was set."""
    largest = max((p.numel() * p.element_size() for p in model.parameters()), default=0)
    if device.type != "cpu" or largest <= GLIBC_MMAP_THRESHOLD_MAX:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # no glibc here (macOS, Windows, musl)
        return False
