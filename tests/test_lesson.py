"""benchmarks/lesson.py's table arithmetic: when a run reaches the fixed score, and how seeds become a cell."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import lesson  # noqa: E402


def test_reached_is_the_first_step_whose_10_step_mean_gets_there():
    score = [0.0] * 10 + [1.0] * 5 + [0.0] * 5
    assert lesson.reached(score, 0.5) == 15  # steps 6-15: five of ten at 1
    assert lesson.reached(score, 0.6) is None
    assert lesson.reached([0.5] * 9, 0.1) is None  # fewer than 10 steps: no 10-step mean


def test_summary_counts_completions_and_seconds_at_that_step():
    steps = 30
    s = {
        "charts/score": [i / steps for i in range(steps)],
        "perf/rollout_seconds": [float(i) for i in range(1, steps + 1)],
        "perf/train_seconds": [2.0 * i for i in range(1, steps + 1)],
    }
    got = lesson.summary(s, "grpo-dense", 0.5)
    step = lesson.reached(s["charts/score"], 0.5)
    assert step == 21  # step k scores (k - 1) / 30: steps 11-20 average 0.483, steps 12-21 0.517
    assert got["completions"] == step * 128 and got["seconds"] == 3.0 * step
    assert got["final"] == sum(s["charts/score"][-3:]) / 3


def test_cell_is_the_median_of_the_seeds_that_got_there():
    assert lesson.cell([3, 1, 2], str) == "2 (1-3)"
    assert lesson.cell([3, None, 1], str) == "2.0 (1-3), 2 of 3 seeds"
    assert lesson.cell([None, None], str) == "never"
