"""benchmarks/bench.py: the arithmetic of its table, and a real run on the small shape."""

import importlib.util
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", os.path.join(REPO, "benchmarks", "bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_measure_leaves_out_the_warmup_step():
    bench = load_bench()
    args = SimpleNamespace(prompts_per_step=2, group_size=4, update_epochs=2, peak_tflops=1.0, nproc=1)
    scalars = {  # cumulative seconds, as bookkeeping.perf_scalars gives them; step 1 is slow (warm-up)
        "perf/rollout_seconds": {1: 10.0, 2: 12.0, 3: 14.0},
        "perf/train_seconds": {1: 5.0, 2: 6.0, 3: 7.0},
        "perf/peak_memory_gb": {1: 1.0, 2: 1.5, 3: 1.25},
        "charts/completion_length": {1: 99.0, 2: 10.0, 3: 30.0},
        "charts/params_policy": {0: 1000.0},
        "charts/params_critic": {0: 500.0},
    }
    row = bench.measure("ppo", "small", scalars, 20, args, torch.device("cuda"))
    # generated: (10 + 30) * 8 completions in 4 s; trained: (20 + 10 + 20 + 30) * 8 tokens, 2 epochs, in 2 s
    assert row["rollout tokens/s"] == "80" and row["training tokens/s"] == "640"
    assert row["MFU"] == f"{100 * 6 * 1500 * 1280 / 2 / 1e12:.1f}%" and row["peak memory (GB)"] == "1.5"
    assert bench.measure("grpo", "small", scalars, 20, args, torch.device("cpu"))["MFU"] == "-"


@pytest.mark.slow
def test_bench_small_shape_on_cpu(tmp_path):
    """~20 s: it builds the small model and runs grpo.py and ppo.py for 2 steps each, in subprocesses."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench.py",
            "--shape",
            "small",
            "--steps",
            "2",
            "--max-new-tokens",
            "8",
            "--keep",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and rows[0].startswith("| script | shape |"), result.stdout
    for row, script in zip(rows[1:], ["grpo", "ppo"]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:2] == [script, "small"]
        rollout, train = (float(c.replace(",", "")) for c in cells[4:6])
        assert rollout > 0 and train > 0 and cells[6] == "-" and float(cells[7]) > 0
    assert re.search(r"1 timed step\(s\) after 1 warm-up", result.stdout)


def load_step_speed():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import step_speed
    finally:
        sys.path.pop(0)
    return step_speed


def test_step_speed_counts_each_phases_matmuls_and_sharing_the_prompt_cuts_them():
    """benchmarks/step_speed.py on the tiny model: FlopCounterMode counts each phase; the update (forward and
    backward) costs about 3 forwards of the reference; computing each group's prompt once counts fewer FLOPs in
    every phase, on the same completions; the timed passes give a time to every phase."""
    from machinery import models
    from machinery.tiny_model import TINY_MODEL

    step_speed = load_step_speed()
    settings = dict(prompts_per_step=2, group_size=4, max_new_tokens=4, temperature=0.7, micro_batch_size=8, beta=0.04)
    results = step_speed.phase_table(models.resolve_model_path(TINY_MODEL), "copy", settings, repeats=1)
    shared, per_row = results["float32"], results["float32, per row"]
    for r in (shared, per_row):
        assert 2.5 < r["flops"]["update"] / r["flops"]["reference"] < 3.1, r["flops"]
        assert all(len(run["seconds"]) == 3 and min(run["cpu"].values()) > 0 for run in r["runs"])
    assert shared["score"] == per_row["score"] and shared["completion_tokens"] == per_row["completion_tokens"]
    for phase in ("rollout", "reference", "update"):
        assert 0 < shared["flops"][phase] < per_row["flops"][phase], phase
