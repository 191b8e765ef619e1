"""machinery/threads.py: the number of threads --threads picks, its reason, its refusals, and the wait policy set
before torch loads."""

import os
import subprocess
import sys

import pytest

from machinery import threads
from machinery.errors import UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def choose(flag="auto", cores=8, default=8, idle=None, env=None, processes=1, sleeps=True):
    return threads.choose_threads(flag, cores, default, idle, env, processes, sleeps)


def test_a_number_given_wins_over_everything():
    assert choose("3", env="1", idle=0.0, sleeps=False) == (3, "--threads 3")
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
    assert choose(env="1", processes=4) == (
        1,
        "OMP_NUM_THREADS=1 in the environment (torchrun sets 1 for several processes)",
    )
    assert choose(env="4", processes=4) == (
        4,
        "OMP_NUM_THREADS=4 in the environment, 4 processes x 4 threads > 8 cores",
    )
    assert choose(env="1") == (1, "OMP_NUM_THREADS=1 in the environment")
    assert choose(env="3", idle=0.0, sleeps=False) == (3, "OMP_NUM_THREADS=3 in the environment")
    assert choose(env="4,2") == (4, "OMP_NUM_THREADS=4,2 in the environment")  # one count per nesting level
    for bad in ("0", "x", ""):
        with pytest.raises(UsageError, match=r"^OMP_NUM_THREADS is .*: set it to a number of threads of at least 1"):
            choose(env=bad)


def test_auto_with_sleeping_threads_is_torchs_default_within_the_process_share():
    assert choose(cores=8, default=8) == (8, "auto: torch's default on 8 cores")
    assert choose(cores=16, default=8) == (8, "auto: torch's default on 16 cores")  # torch counts physical cores
    assert choose(cores=2, default=2, idle=0.0) == (2, "auto: torch's default on 2 cores")  # sleeping: load ignored
    assert choose(cores=8, default=8, processes=4) == (2, "auto: 8 cores / 4 processes")
    assert choose(cores=8, default=8, processes=3) == (2, "auto: 8 cores / 3 processes")  # 3 x 2 <= 8
    assert choose(cores=2, default=2, processes=4) == (1, "auto: 2 cores / 4 processes")  # never 0
    for cores in range(1, 9):
        for processes in range(1, 9):
            n, _ = choose(cores=cores, default=cores, processes=processes)
            assert n >= 1 and (n * processes <= cores or n == 1)


def test_auto_with_spinning_threads_takes_at_most_the_idle_cores():
    spin = dict(cores=2, default=2, sleeps=False)
    assert choose(idle=1.0, **spin) == (1, "auto: 1.0 of 2 cores idle at start")
    assert choose(idle=0.2, **spin) == (1, "auto: 0.2 of 2 cores idle at start")  # never 0
    assert choose(idle=1.7, **spin) == (2, "auto: torch's default on 2 cores")  # rounded: a core nearly idle counts
    assert choose(idle=None, **spin) == (2, "auto: torch's default on 2 cores")  # unknown: torch's default
    assert choose(cores=8, default=8, idle=6.0, processes=2, sleeps=False) == (4, "auto: 8 cores / 2 processes")
    assert choose(cores=8, default=8, idle=2.0, processes=2, sleeps=False) == (2, "auto: 2.0 of 8 cores idle at start")


def test_idle_cores_is_a_share_of_the_machine():
    idle = threads.idle_cores(os.cpu_count(), seconds=0.05)
    assert idle is None or 0 <= idle <= os.cpu_count()


def policy(code, **env):
    env = {**{k: v for k, v in os.environ.items() if k not in threads.WAIT_VARIABLES}, **env}
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return run.stdout.split()


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_the_scripts_set_the_wait_policy_before_torch_loads(script):
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads it: the scripts import threads.py before torch."""
    assert policy(f"import os, {script}; print(os.environ.get('OMP_WAIT_POLICY'), {script}.threads.SLEEPS)") == [
        "PASSIVE",
        "True",
    ]


def test_a_wait_policy_of_the_user_is_kept_and_a_late_import_sets_none():
    code = "import os; from machinery import threads; print(os.environ.get('OMP_WAIT_POLICY'), threads.SLEEPS)"
    assert policy(code, GOMP_SPINCOUNT="300000") == ["None", "False"]
    assert policy(code, OMP_WAIT_POLICY="passive") == ["passive", "True"]
    assert policy(code, OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "False"]
    assert policy("import torch\n" + code) == ["None", "False"]  # torch's OpenMP has read its settings already


def test_resolve_sets_torch_and_prints_the_reason(capsys, monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert threads.resolve_threads("auto") == 2 and torch.get_num_threads() == 2
        assert capsys.readouterr().out.startswith("threads: 2 (OMP_NUM_THREADS=2 in the environment; ")
        assert threads.resolve_threads("1") == 1 and torch.get_num_threads() == 1
        assert capsys.readouterr().out == "threads: 1 (--threads 1; one thread never waits)\n"
    finally:
        torch.set_num_threads(before)
