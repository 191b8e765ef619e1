"""The seed table of docs/benchmarks.md: the default run of grpo.py or ppo.py over several seeds, one row per seed.

    python benchmarks/seeds.py grpo --seeds 1-10 --jobs 2            # runs them, then prints the table
    python benchmarks/seeds.py ppo --runs-dir runs/seeds             # only tabulates runs already made

Each run is `python SCRIPT.py --seed N --sample-every 0 --output-dir RUNS_DIR/SCRIPT-N` (extra flags after
`--` are passed on). The figures come from each run's TensorBoard scalars: mean score over the first 5% and
the last 10% of steps, the step where the 10-step mean score first reaches 0.9, the completion length (EOS
included) over the last 10%, and the wall time (rollout + update seconds, start-up excluded).
"""

import argparse
import glob
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def seeds_of(text):
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def row(script, seed, run_dir):
    s = scalars(run_dir)
    score, length = s["charts/score"], s["charts/completion_length"]
    n_first, n_last = max(1, len(score) // 20), max(1, len(score) // 10)
    reached = next((i + 10 for i in range(len(score) - 9) if sum(score[i : i + 10]) / 10 >= 0.9), None)
    seconds = s["perf/rollout_seconds"][-1] + s["perf/train_seconds"][-1]
    return (
        f"| {script}.py | {seed} | {sum(score[:n_first]) / n_first:.3f} | {sum(score[-n_last:]) / n_last:.3f} "
        f"| {reached or 'never'} | {sum(length[-n_last:]) / n_last:.2f} | {seconds:.0f} s |"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", choices=["grpo", "ppo"])
    parser.add_argument("--seeds", default="1-10", help="a seed or a range, e.g. 1-10")
    parser.add_argument("--jobs", type=int, default=0, help="runs at once (0: only tabulate existing runs)")
    parser.add_argument("--runs-dir", default="runs/seeds")
    a, extra = parser.parse_known_args()
    extra = [x for x in extra if x != "--"]
    seeds = seeds_of(a.seeds)

    def run(seed):
        out = os.path.join(a.runs_dir, f"{a.script}-{seed}")
        cmd = [
            sys.executable,
            os.path.join(REPO, f"{a.script}.py"),
            "--seed",
            str(seed),
            "--sample-every",
            "0",
            "--output-dir",
            out,
            *extra,
        ]
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    if a.jobs:
        with ThreadPoolExecutor(a.jobs) as pool:
            list(pool.map(run, seeds))
    print("| script | seed | first 5% | last 10% | 10-step mean >= 0.9 at step | length (tokens) | wall time |")
    print("|---|---|---|---|---|---|---|")
    for seed in seeds:
        found = sorted(glob.glob(os.path.join(a.runs_dir, f"{a.script}-{seed}", "*")))
        print(row(a.script, seed, found[-1]) if found else f"| {a.script}.py | {seed} | no run in {a.runs_dir} |")


if __name__ == "__main__":
    main()
