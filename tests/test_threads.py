"""machinery/threads.py: the number of threads --threads picks, its reason and its refusals."""

import os
import types

import pytest
import torch

from machinery import threads
from machinery.errors import UsageError
from machinery.tiny_model import TINY_MODEL


def choose(flag="auto", cores=8, default=8, idle=None, env=None, processes=1):
    return threads.choose_threads(flag, cores, default, idle, env, processes)


def test_a_number_given_wins_over_everything():
    assert choose("3", env="1", idle=0.0) == (3, "--threads 3")
    assert choose("32", cores=8) == (32, "--threads 32 > 8 cores")
    assert choose("2", cores=8, processes=8) == (2, "--threads 2, 8 processes x 2 threads > 8 cores")
    assert choose("1", cores=8, processes=8) == (1, "--threads 1")


@pytest.mark.parametrize("flag", ["0", "-1", "33", "abc", "1.5", "", " 2"])
def test_an_absurd_number_is_refused_in_one_line(flag):
    with pytest.raises(UsageError) as e:
        choose(flag, cores=8)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"--threads is {flag!r}: pass auto, or a number")
    assert "from 1 to 32 (this machine has 8 cores)" in message


def test_omp_num_threads_of_the_user_or_torchrun_is_kept():
    torchrun = "OMP_NUM_THREADS=1 in the environment (torchrun sets 1 for several processes)"
    assert choose(env="1", processes=4) == (1, torchrun)
    assert choose(env="4", processes=4) == (
        4,
        "OMP_NUM_THREADS=4 in the environment, 4 processes x 4 threads > 8 cores",
    )
    assert choose(env="1") == (1, "OMP_NUM_THREADS=1 in the environment")
    assert choose(env="3", idle=0.0) == (3, "OMP_NUM_THREADS=3 in the environment")  # the load is not asked
    assert choose(env="4,2") == (4, "OMP_NUM_THREADS=4,2 in the environment")  # one count per nesting level
    for bad in ("0", "x", "", "33", "100000"):  # at most 4 x the 8 cores, as --threads
        with pytest.raises(UsageError, match=r"^OMP_NUM_THREADS is .*: set it to a number of threads from 1 to 32 "):
            choose(env=bad)


def test_auto_is_torchs_default_within_the_process_share():
    assert choose(cores=8, default=8) == (8, "auto: torch's default on 8 cores")  # the load unknown
    assert choose(cores=16, default=8, idle=16.0) == (8, "auto: torch's default on 16 cores, 16.0 idle at start")
    assert choose(cores=8, default=8, processes=4) == (2, "auto: 8 cores / 4 processes")
    assert choose(cores=8, default=8, processes=3) == (2, "auto: 8 cores / 3 processes")  # 3 x 2 <= 8
    assert choose(cores=2, default=2, processes=4) == (1, "auto: 2 cores / 4 processes")  # never 0
    for cores in range(1, 9):
        for processes in range(1, 9):
            n, _ = choose(cores=cores, default=cores, processes=processes)
            assert n >= 1 and (n * processes <= cores or n == 1)


def test_auto_takes_at_most_the_cores_idle_at_start():
    assert choose(cores=2, default=2, idle=2.0) == (2, "auto: torch's default on 2 cores, 2.0 idle at start")
    assert choose(cores=2, default=2, idle=1.7) == (2, "auto: torch's default on 2 cores, 1.7 idle at start")
    assert choose(cores=2, default=2, idle=1.0) == (1, "auto: 1.0 of 2 cores idle at start")  # one busy process
    assert choose(cores=2, default=2, idle=1.4) == (1, "auto: 1.4 of 2 cores idle at start")
    assert choose(cores=2, default=2, idle=0.0) == (1, "auto: 0.0 of 2 cores idle at start")  # never 0
    assert choose(cores=8, default=8, idle=6.0, processes=2) == (4, "auto: 8 cores / 2 processes, 6.0 idle at start")
    assert choose(cores=8, default=8, idle=2.0, processes=2) == (2, "auto: 2.0 of 8 cores idle at start")


def test_idle_cores_is_a_share_of_the_machine():
    idle = threads.idle_cores(seconds=0.05)
    assert idle is None or 0 <= idle <= os.cpu_count()


def test_resolve_sets_torch_and_prints_the_reason(capsys, monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert threads.resolve_threads("auto") == 2 and torch.get_num_threads() == 2
        assert capsys.readouterr().out == "threads: 2 (OMP_NUM_THREADS=2 in the environment)\n"
        assert threads.resolve_threads("1") == 1 and torch.get_num_threads() == 1
        assert capsys.readouterr().out == "threads: 1 (--threads 1)\n"
    finally:
        torch.set_num_threads(before)


def test_threads_for_idle_is_the_idle_cores_rounded_within_one_and_the_cap():
    assert [threads.threads_for_idle(2, idle) for idle in (0.0, 0.4, 1.0, 1.4, 1.6, 2.0, 5.0)] == [1, 1, 1, 1, 2, 2, 2]
    assert threads.threads_for_idle(8, 5.5) == 6 and threads.threads_for_idle(8, 3.0) == 3


def test_idle_between_leaves_out_this_process_own_time(monkeypatch):
    """The busy time of the machine less this process's: a run that spins its own threads is not "other load"."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    # 2 s of wall time: the machine was busy 6 core-seconds, 4 of them this process's: others held 1 core.
    assert threads.idle_between((10.0, 100.0, 50.0), (12.0, 106.0, 54.0)) == pytest.approx(3.0)
    # this process alone: every busy second its own, all 4 cores free to it
    assert threads.idle_between((10.0, 100.0, 50.0), (12.0, 104.0, 54.0)) == pytest.approx(4.0)
    assert threads.idle_between((10.0, None, 50.0), (12.0, None, 54.0)) is None  # no /proc/stat
    assert threads.idle_between((10.0, 100.0, 50.0), (10.0, 100.0, 50.0)) is None  # no time passed
    # every core busy with others: none idle, never below 0
    assert threads.idle_between((0.0, 0.0, 0.0), (1.0, 9.0, 0.0)) == 0.0


def test_auto_follows_a_busy_process_that_starts_and_stops_mid_run(monkeypatch, capsys):
    """Under auto on one process the threads follow the idle cores after each step, at most once a CHECK_EVERY:
    a busy process that starts mid-run takes a thread away, and gives it back when it stops."""
    import torch

    clock = {"wall": 0.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(threads, "cpu_times", lambda: (clock["wall"], clock["busy"], clock["own"]))
    monkeypatch.setattr(threads, "time", types.SimpleNamespace(perf_counter=lambda: clock["wall"]))
    monkeypatch.setattr(threads, "idle_cores", lambda seconds=0.2: 2.0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setitem(threads.TORCH_DEFAULT, "threads", 2)
    before = torch.get_num_threads()

    def seconds(wall, ours, others):
        clock["wall"] += wall
        clock["own"] += ours
        clock["busy"] += ours + others
        return threads.follow_idle_cores()

    try:
        assert threads.resolve_threads("auto") == 2
        assert "followed after each step, perf/threads" in capsys.readouterr().out
        assert seconds(0.5, 1.0, 0.0) == 2  # not yet CHECK_EVERY since the start: not checked
        assert seconds(0.5, 1.0, 0.0) == 2  # checked: alone, both cores its own
        assert seconds(1.0, 1.0, 1.0) == 1  # a busy process started: it held one core over the last second
        assert seconds(1.0, 1.0, 1.0) == 1
        assert seconds(0.3, 0.3, 0.0) == 1  # it stopped, but not checked yet
        assert seconds(0.7, 1.4, 0.0) == 2  # checked: the core is back
        assert seconds(2.0, 2.0, 1.2) == 1  # 0.6 of a core busy elsewhere: 1.4 idle rounds to 1
        assert threads.follow_before_forward(torch.nn.Linear(1, 1), ()) is None  # a pre-hook: inputs unchanged
        assert threads.resolve_threads("2") == 2 and not threads.FOLLOW  # a number given: fixed
        assert seconds(2.0, 2.0, 2.0) == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert threads.resolve_threads("auto") == 2 and not threads.FOLLOW  # OMP_NUM_THREADS: fixed
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert threads.resolve_threads("auto") == 1 and not threads.FOLLOW  # torchrun: its share, fixed
    finally:
        torch.set_num_threads(before)
        threads.FOLLOW.clear()


@pytest.mark.parametrize("cores, default, cap", [(8, 2, 2), (2, 4, 2)])
def test_auto_follows_idle_cores_up_to_torchs_default_and_its_cores(monkeypatch, cores, default, cap):
    """Following the idle cores, auto never goes above torch's own default (2, with all 8 cores idle), nor above
    the cores this process may run on (2 of the machine's 8, all idle, where torch's default is 4)."""
    import torch

    clock = {"wall": 0.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(threads, "cpu_times", lambda: (clock["wall"], clock["busy"], clock["own"]))
    monkeypatch.setattr(threads, "time", types.SimpleNamespace(perf_counter=lambda: clock["wall"]))
    monkeypatch.setattr(threads, "idle_cores", lambda seconds=0.2: 8.0)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 8)  # the machine's; `cores` this process's affinity
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setitem(threads.TORCH_DEFAULT, "threads", default)
    before = torch.get_num_threads()
    try:
        assert threads.resolve_threads("auto") == cap
        for _ in range(3):  # seconds with every core idle but this process's own
            clock["wall"] += 2.0
            clock["own"] = clock["busy"] = clock["busy"] + 1.0
            assert threads.follow_idle_cores() == cap
    finally:
        torch.set_num_threads(before)
        threads.FOLLOW.clear()


def test_every_loaded_model_checks_the_idle_cores_before_its_forward_pass():
    """A long step (a real model's rollout) sees a busy process start within its forward passes, not at its end."""
    from machinery import models

    model = models.load_causal_lm(TINY_MODEL, "cpu")
    assert threads.follow_before_forward in model._forward_pre_hooks.values()


def test_freed_memory_is_reused_without_page_faults():
    """After keep_freed_memory (a model with a weight over 32 MB, on a CPU), a step that makes and frees tensors of
    32-128 MB, repeated, soon lands on pages already mapped: five steps then fault fewer pages than one fresh step
    (glibc's default: ~94,000 every step)."""
    import resource

    large, small = torch.nn.Embedding(2**16, 2**7 + 1), torch.nn.Embedding(2**16, 2**7)  # 32 MB + 256 KB, 32 MB
    assert not threads.keep_freed_memory(small, torch.device("cpu"))  # glibc reuses its blocks already: left alone
    assert not threads.keep_freed_memory(large, torch.device("meta"))  # not a CPU: left alone
    if not threads.keep_freed_memory(large, torch.device("cpu")):
        pytest.skip("not glibc: the allocator's settings are left alone")

    def step():
        a, b = torch.zeros(3 * 2**23), torch.zeros(5 * 2**22)  # zeroing writes every page
        del a
        return b[:10] + torch.zeros(2**24).sum() + torch.zeros(2**25).sum()

    faults = []
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    fresh = (3 * 2**23 + 5 * 2**22 + 2**24 + 2**25) * 4 // 4096  # the pages of one step: 90,112
    assert sum(faults[-5:]) < fresh, faults  # five steps together fault fewer pages than one fresh step
