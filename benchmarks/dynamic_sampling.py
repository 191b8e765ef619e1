"""DAPO's dynamic sampling measured on a right-or-wrong reward: grpo.py with and without --dynamic-sampling.

    python benchmarks/dynamic_sampling.py --seeds 1-3 --num-steps 150      # runs, then prints the table

The task is this file's own: write the first digit of a two-digit prompt, 1 for exactly that digit and 0 otherwise
(python:THIS_FILE:first_digit). From the random tiny model almost every group of 8 scores all 0, so a plain GRPO
step learns from few groups; dynamic sampling samples more rounds until the batch holds groups whose rewards
differ. Each run logs the greedy held-out accuracy (--eval-every); the table gives it at the end, the completions
sampled to get there (dynamic sampling samples more than prompts_per_step * group_size a step) and the rollout
and update seconds.
"""

import argparse
import glob
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.seeds import scalars, seeds_of  # noqa: E402

EXAMPLES = [{"prompt": f"{n:02d}=", "answer": f"{n // 10}"} for n in range(100)]  # 10 held out, each digit in training


def first_digit(prompt, completion, answer):
    """1 for exactly the answer, else 0: right or wrong, no partial credit."""
    return float(completion == answer)


def run(seed, dynamic, num_steps, runs_dir, extra):
    out = os.path.join(runs_dir, f"{'dynamic' if dynamic else 'plain'}-{seed}")
    if not os.path.isdir(out):
        command = [
            sys.executable,
            "grpo.py",
            "--task",
            f"python:{os.path.abspath(__file__)}:first_digit",
            "--max-new-tokens",
            "2",
            "--seed",
            str(seed),
            "--num-steps",
            str(num_steps),
            "--eval-every",
            "10",
            "--sample-every",
            "0",
            "--output-dir",
            out,
            *(["--dynamic-sampling"] if dynamic else []),
            *extra,
        ]
        subprocess.run(
            command,
            check=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            stdout=subprocess.DEVNULL,
        )
    s = scalars(glob.glob(os.path.join(out, "*", ""))[0])  # the run's own folder inside --output-dir
    accuracy = s["eval/accuracy"]
    first = next((10 * (i + 1) for i, a in enumerate(accuracy) if a >= 0.5), None)
    seconds = s["perf/rollout_seconds"][-1] + s["perf/train_seconds"][-1]
    return (
        accuracy[-1],
        first,
        sum(s["charts/sampled_completions"]),
        seconds,
        sum(s["charts/informative_groups"]) / len(s["charts/informative_groups"]),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1-3")
    parser.add_argument("--num-steps", type=int, default=150)
    parser.add_argument("--runs-dir", default="runs/dynamic_sampling")
    args, extra = parser.parse_known_args()
    print(
        "| run | seed | final greedy accuracy | step accuracy >= 0.5 | completions sampled "
        "| informative groups | seconds |"
    )
    print("|---|---|---|---|---|---|---|")
    for dynamic in (False, True):
        for seed in seeds_of(args.seeds):
            acc, first, sampled, seconds, informative = run(seed, dynamic, args.num_steps, args.runs_dir, extra)
            name = "--dynamic-sampling" if dynamic else "plain"
            print(
                f"| {name} | {seed} | {acc:.3f} | {first or 'never'} | {sampled:.0f} "
                f"| {informative:.2f} | {seconds:.0f} |"
            )


if __name__ == "__main__":
    main()
