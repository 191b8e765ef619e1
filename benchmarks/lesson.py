"""docs/lesson.md: the rows of the PPO-GRPO comparison, each measured by runs of the two scripts.

    python benchmarks/lesson.py                  # runs it all (3 seeds each), draws docs/lesson/*.png, rewrites
                                                 # the part of docs/lesson.md between its two markers
    python benchmarks/lesson.py --loaded         # the same, saying on the page that other jobs shared the CPU

15 training runs (9 of PPO, 120 steps; 6 of GRPO, 200 steps) and 2 one-step memory runs: about 20 minutes
alone on 2 cores, estimated from the default runs' seconds per step (PPO 0.5, GRPO 0.2); runs already
finished in --runs-dir are kept, so a stopped benchmark continues where it was.
    python benchmarks/lesson.py --jobs 1         # one run at a time (2 threads each) instead of 2 (1 thread each)
    python benchmarks/lesson.py --tabulate       # only re-reads the runs already in --runs-dir

1. fits best with: on copy:4:dense (each character is paid, on the token that writes it, what it changes of the
   copy score: R(y<=t) - R(y<t)), PPO given that dense reward, PPO given only its total at the last token (task
   copy:4, the same total), and GRPO (outcome = the sum); on copy (one score per completion, at the end), PPO and
   GRPO. Per run:
   completions sampled and wall time (rollout + update seconds, start-up excluded) until the 10-step mean
   score first reaches a fixed score, and the final score (mean of the last 10% of steps).
2. credit assignment: one completion of GRPO's seed-1 dump (its last step), its per-token advantage under
   GRPO (one value, r - group mean) and under PPO's GAE (each PPO run's final critic, gamma 1, lambda 0.95,
   before whitening, KL penalty left out), same prompt and completion.
3. baseline quality: losses/explained_variance over training (PPO: its critic, per token; GRPO: the group
   mean, per completion), mean of the seeds.
4. models in memory: each script for 1 step (the optimizer state exists from the first update on) on one
   random-init 25M-parameter Qwen2 (byte tokenizer), in a process of its own: parameters held
   (charts/params_*) and peak resident memory after step 1 (perf/peak_memory_gb).

Plotting needs matplotlib (requirements/extra.txt); without it the table is still written and the figures
are skipped, with a message saying so.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DOCS = os.path.join(REPO, "docs", "lesson")
BEGIN, END = "<!-- lesson.py: begin -->", "<!-- lesson.py: end -->"
SEEDS = (1, 2, 3)
DENSE_FLAGS = ["--max-new-tokens", "6"]  # 4 digits and EOS, one token to spare (as the default copy's 5)
# name: (script, task, extra flags, label). Each runs a fixed number of steps; GRPO samples 128 completions a step
# (16 prompts x 8), PPO 64; GRPO's steps are cheaper (no critic, one update pass): its 200 take about PPO's 120.
RUNS = {
    "ppo-dense": ("ppo", "copy:4:dense", ["--num-steps", "120", *DENSE_FLAGS], "PPO, dense reward"),
    "ppo-final": ("ppo", "copy:4", ["--num-steps", "120", *DENSE_FLAGS], "PPO, final score only"),
    "grpo-dense": ("grpo", "copy:4:dense", ["--num-steps", "200", *DENSE_FLAGS], "GRPO, outcome = sum"),
    "ppo-outcome": ("ppo", "copy", ["--num-steps", "120"], "PPO"),
    "grpo-outcome": ("grpo", "copy", ["--num-steps", "200"], "GRPO"),
}
TASKS = {
    "dense": ("copy:4:dense", ["ppo-dense", "ppo-final", "grpo-dense"], 0.5),
    "outcome": ("copy", ["ppo-outcome", "grpo-outcome"], 0.5),
}  # task, runs, fixed score to reach
DUMP_STEP = 200  # the step of grpo-dense seed 1 whose completion figure 2 shows: its last
MEMORY_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
MEMORY_FLAGS = ["--num-steps", "1", "--prompts-per-step", "8", "--max-new-tokens", "8", "--micro-batch-size", "8"]


def run_dir(runs_dir, name, seed):
    return os.path.join(runs_dir, f"{name}-{seed}")


def finished(folder):
    return any(
        os.path.isdir(os.path.join(folder, d, "final")) for d in (os.listdir(folder) if os.path.isdir(folder) else [])
    )


def train(runs_dir, name, seed, threads):
    """One run in a subprocess (skipped when its final model is there); its log beside it."""
    out = run_dir(runs_dir, name, seed)
    if finished(out):
        return
    script, task, flags, _ = RUNS[name]
    dump = ["--dump-dir", os.path.join(out, "dump")] if (name, seed) == ("grpo-dense", 1) else []
    cmd = [
        sys.executable,
        os.path.join(REPO, f"{script}.py"),
        "--task",
        task,
        "--seed",
        str(seed),
        "--sample-every",
        "0",
        "--output-dir",
        out,
        *flags,
        *dump,
    ]
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with open(os.path.join(out, "log.txt"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (sub,) = [d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)) and d != "dump"]
    events = EventAccumulator(os.path.join(folder, sub), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def completions_per_step(name):
    return 64 if RUNS[name][0] == "ppo" else 128


def reached(score, threshold):
    """The first step (1-based) whose 10-step mean score (that step and the 9 before) is >= threshold, or None."""
    return next((i + 10 for i in range(len(score) - 9) if sum(score[i : i + 10]) / 10 >= threshold), None)


def summary(s, name, threshold):
    score = s["charts/score"]
    step = reached(score, threshold)
    seconds = [r + t for r, t in zip(s["perf/rollout_seconds"], s["perf/train_seconds"])]
    n_last = max(1, len(score) // 10)
    return dict(
        completions=step * completions_per_step(name) if step else None,
        seconds=seconds[step - 1] if step else None,
        final=sum(score[-n_last:]) / n_last,
        total_seconds=seconds[-1],
        steps=len(score),
    )


def cell(values, fmt):
    """Median (min-max) of the seeds that reached it, and how many did, or `never`."""
    got = [v for v in values if v is not None]
    if not got:
        return "never"
    text = fmt(statistics.median(got)) + (f" ({fmt(min(got))}-{fmt(max(got))})" if len(got) > 1 else "")
    return text + (f", {len(got)} of {len(values)} seeds" if len(got) < len(values) else "")


# ---------------------------------------------------------------------------------------------------
# 4. Models in memory: each script on one 25M-parameter model, 3 steps, in a process of its own.
# ---------------------------------------------------------------------------------------------------


def measure_memory(runs_dir):
    import bench
    import torch

    folder = os.path.join(runs_dir, "memory")
    model = os.path.join(folder, "model")
    if not os.path.isdir(model):
        bench.SHAPES["lesson"] = dict(MEMORY_SHAPE, vocab_size=len(bench.byte_tokenizer()))
        bench.build_model("lesson", model, torch.device("cpu"))
    batch = {"grpo": ["--prompts-per-step", "1", "--group-size", "8"], "ppo": ["--prompts-per-step", "8"]}
    for script in ("grpo", "ppo"):  # 8 completions a step each, one micro-batch
        out = os.path.join(folder, script)
        if os.path.isdir(out):
            continue
        cmd = [
            sys.executable,
            os.path.join(REPO, f"{script}.py"),
            "--model",
            model,
            "--task",
            "copy",
            "--sample-every",
            "0",
            "--no-chat-template",
            "--output-dir",
            out,
            *MEMORY_FLAGS,
            *batch[script],
        ]
        os.makedirs(out)
        with open(os.path.join(out, "log.txt"), "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def memory_rows(runs_dir):
    rows = []
    for script, held in (("grpo", "policy + reference"), ("ppo", "policy + critic + reference")):
        s = scalars(os.path.join(runs_dir, "memory", script))
        params = {k.removeprefix("charts/params_"): v[0] for k, v in s.items() if k.startswith("charts/params_")}
        trained = params.get("policy", 0) + params.get("critic", 0)
        frozen = params.get("reference", 0)
        state_gb = (16 * trained + 4 * frozen) / 1e9  # float32 weights, gradients, two AdamW moments; frozen: weights
        rows.append(
            f"| {script}.py | {held} | {(trained + frozen) / 1e6:.1f}M | {trained / 1e6:.1f}M | "
            f"{state_gb:.2f} GB | {s['perf/peak_memory_gb'][0] * 2**30 / 1e9:.2f} GB |"
        )
    return rows


# ---------------------------------------------------------------------------------------------------
# Figures (matplotlib) and the page's generated part.
# ---------------------------------------------------------------------------------------------------


def smooth(values, window=10):
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def curves(plt, runs, tag, ylabel, filename, thresholds=None):
    """One panel a task: `tag` (10-step mean) against completions sampled, each seed thin, their mean thick."""
    fig, axes = plt.subplots(1, len(TASKS), figsize=(11, 3.8))
    for ax, (key, (task, names, threshold)) in zip(axes, TASKS.items()):
        for i, name in enumerate(names):
            color = f"C{i}"
            series = [smooth(runs[name, seed][tag]) for seed in SEEDS if (name, seed) in runs]
            x = [(k + 1) * completions_per_step(name) for k in range(min(map(len, series)))]
            for y in series:
                ax.plot(x, y[: len(x)], color=color, alpha=0.3, lw=0.8)
            mean = [statistics.mean(y[k] for y in series) for k in range(len(x))]
            ax.plot(x, mean, color=color, lw=2, label=RUNS[name][3])
        if thresholds:
            ax.axhline(threshold, color="gray", ls=":", lw=1)
        ax.set_title(f"task {task}")
        ax.set_xlabel("completions sampled")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, filename), dpi=110)
    plt.close(fig)


def credit_example(runs_dir):
    """A completion of grpo-dense seed 1's dump at DUMP_STEP, and its per-token advantages under each method."""
    import torch
    from safetensors.torch import load_file

    import ppo
    from machinery import generation, models, scoring
    from machinery.tiny_model import TINY_MODEL
    from tasks import load_task

    d = load_file(os.path.join(run_dir(runs_dir, "grpo-dense", 1), "dump", f"step{DUMP_STEP:06d}.safetensors"))
    tokenizer = models.load_tokenizer(TINY_MODEL)
    eos = [tokenizer.eos_token_id]
    prompts = tokenizer.batch_decode(d["prompt_ids"], skip_special_tokens=True)
    completions = generation.decode_completions(tokenizer, d["completion_ids"], d["completion_mask"], eos)
    rewards, group = d["rewards"], 8
    spread = rewards.view(-1, group).std(1).repeat_interleave(group) > 0
    ended = torch.isin(d["completion_ids"], torch.tensor(eos)).any(1)

    def first_wrong(k):
        answer = prompts[k].removesuffix("=")
        return next(j for j, (a, c) in enumerate(zip(answer + " " * 9, completions[k] + " " * 9)) if a != c)

    # The best completion short of right, with its EOS, in a group not all equal; a wrong character mid-answer.
    candidates = [k for k in range(len(rewards)) if spread[k] and ended[k] and 0 < rewards[k] < 1]
    i = min(candidates, key=lambda k: (-rewards[k].item(), abs(first_wrong(k) - 1.5), k))
    rows = slice(i, i + 1)
    ids = torch.cat([d["prompt_ids"][rows], d["completion_ids"][rows]], 1)
    attention = torch.cat([d["prompt_mask"][rows], d["completion_mask"][rows]], 1)
    mask = d["completion_mask"][rows]
    has_eos = bool(torch.isin(d["completion_ids"][rows], torch.tensor(eos))[mask.bool()].any())
    result = {"GRPO: r - group mean, every token": None}
    for name, task in (("ppo-dense", "copy:4:dense"), ("ppo-final", "copy:4")):
        (sub,) = [
            x
            for x in os.listdir(run_dir(runs_dir, name, 1))
            if x != "dump" and os.path.isdir(os.path.join(run_dir(runs_dir, name, 1), x))
        ]
        critic = ppo.load_critic(os.path.join(run_dir(runs_dir, name, 1), sub, "critic"), torch.device("cpu"))
        with torch.no_grad():
            values = ppo.token_values(critic, ids, attention, mask)
        token_rewards = scoring.score_tokens(
            load_task(task),
            tokenizer,
            prompts[rows],
            completions[rows],
            [prompts[i].removesuffix("=")],
            d["completion_ids"][rows],
            mask,
        )
        token_rewards -= scoring.score_at_last_token(torch.tensor([0.0 if has_eos else 0.3]), mask)
        advantages, _ = ppo.compute_gae(token_rewards, values, mask, 1.0, 0.95)
        result[f"PPO GAE, {'dense reward' if name == 'ppo-dense' else 'final score only'}"] = advantages[0][
            mask[0].bool()
        ]
    n = int(mask.sum())
    grpo_adv = (rewards[i] - rewards.view(-1, group)[i // group].mean()).item()
    result["GRPO: r - group mean, every token"] = torch.full((n,), grpo_adv)
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in d["completion_ids"][i][:n].tolist()]
    return prompts[i], completions[i], rewards[i].item(), tokens, result


def credit_figure(plt, example):
    prompt, completion, reward, tokens, result = example
    answer = prompt.removesuffix("=")
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(result)
    for j, (label, values) in enumerate(result.items()):
        ax.bar([k + (j - 1) * width for k in range(len(tokens))], values.tolist(), width, label=label)
    marks = [
        ("right" if k < len(answer) and t == answer[k] else "wrong") if k < len(completion) else ""
        for k, t in enumerate(tokens)
    ]
    ax.set_xticks(range(len(tokens)), [f"{t}\n{m}" for t, m in zip(tokens, marks)])
    ax.axhline(0, color="black", lw=0.8)
    ax.set_title(f"prompt {prompt!r}, completion {completion!r} (copy:4:dense, reward {reward:.2f})", fontsize=10)
    ax.set_ylabel("advantage (reward units, unwhitened)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(DOCS, "credit.png"), dpi=110)
    plt.close(fig)


def write_section(runs_dir, elapsed, loaded):
    runs = {}
    for name in RUNS:
        for seed in SEEDS:
            if finished(run_dir(runs_dir, name, seed)):  # a run stopped halfway is left out
                runs[name, seed] = scalars(run_dir(runs_dir, name, seed))
    lines = [BEGIN, "# The lesson, measured: PPO next to GRPO", ""]
    took = f", {elapsed / 60:.0f} minutes in all" if elapsed else ""
    lines += [
        f"`python benchmarks/lesson.py` (CPU, the built-in tiny model, seeds {', '.join(map(str, SEEDS))}, "
        f"by default two runs at a time (--jobs), one thread each{took}) makes this page down to its end marker: the "
        "tables, and the figures in `docs/lesson/`.",
        "Wall times are rollout + update seconds, start-up excluded"
        + (
            ", measured while other jobs shared the 2 cores: compare them with each other, not with a machine "
            "of your own."
            if loaded
            else "."
        ),
        "",
        "## Fits best with: a dense task and an outcome task",
        "",
        "`copy:4:dense`: each character is paid, on the token that writes it, what it changes of the copy score "
        "(R(y<=t) - R(y<t): 1 / 4 for a right one among the 4 digits, a negative amount for one past them). PPO "
        'gets it there; PPO "final score only" runs task `copy:4`, the same total at the '
        "last token; GRPO's outcome is the sum, so its runs on `copy:4:dense` and `copy:4` are the same. `copy`: the "
        "default task, one score per completion (its share of right characters), at the end. Cells: median over the "
        "seeds (min-max); the fixed score is reached when the 10-step mean score first gets there.",
        "",
        "| task | run | completions sampled to reach the fixed score | wall time to reach it | final score "
        "(last 10% of steps) | steps x completions a step |",
        "|---|---|---|---|---|---|",
    ]
    for key, (task, names, threshold) in TASKS.items():
        for name in names:
            got = [summary(runs[name, seed], name, threshold) for seed in SEEDS if (name, seed) in runs]
            steps = RUNS[name][2][RUNS[name][2].index("--num-steps") + 1]
            done = [seed for seed in SEEDS if (name, seed) in runs]
            label = RUNS[name][3] + (
                f" (seed{'s' * (len(done) > 1)} {', '.join(map(str, done))} only)" if len(done) < len(SEEDS) else ""
            )
            lines.append(
                f"| `{task}` (score {threshold}) | {label} "
                f"| {cell([g['completions'] for g in got], lambda v: f'{v:,.0f}')} "
                f"| {cell([g['seconds'] for g in got], lambda v: f'{v:.0f} s')} "
                f"| {cell([g['final'] for g in got], lambda v: f'{v:.3f}')} "
                f"| {steps} x {completions_per_step(name)} |"
            )
    lines += ["", "![score against completions sampled](lesson/fits.png)", ""]

    example = credit_example(runs_dir)
    prompt, completion, reward, tokens, result = example
    lines += [
        "## Credit assignment: per token (PPO) and per completion (GRPO)",
        "",
        f"One completion from GRPO's seed-1 run on `copy:4:dense` at step {DUMP_STEP}: prompt `{prompt}`, completion "
        f"`{completion}`, reward {reward:.2f}. GRPO gives every token the same advantage, the reward minus its "
        "group's mean (before the division by the std); PPO's GAE, from each PPO run's critic at the end of its "
        "training (gamma 1, lambda 0.95, before whitening, KL penalty left out), gives each token its own:",
        "",
    ]
    lines += ["| token | " + " | ".join(f"`{t}`" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
    for label, values in result.items():
        lines.append(f"| {label} | " + " | ".join(f"{v:+.3f}" for v in values.tolist()) + " |")
    lines += ["", "![per-token advantages of one completion](lesson/credit.png)", ""]

    lines += [
        "## Baseline: a learned critic against the group mean",
        "",
        "`losses/explained_variance`: 1 - Var(target - baseline) / Var(target). PPO: returns against the "
        "critic's values, over real tokens; GRPO: rewards against their group's mean (the completion itself "
        "included, as GRPO computes it), over completions. Mean over the last 10% of steps, median of the "
        "seeds (min-max):",
        "",
        "| task | run | explained variance, last 10% of steps |",
        "|---|---|---|",
    ]
    for key, (task, names, _) in TASKS.items():
        for name in names:
            ev = []
            for seed in SEEDS:
                if (name, seed) in runs:
                    v = runs[name, seed]["losses/explained_variance"]
                    ev.append(sum(v[-max(1, len(v) // 10) :]) / max(1, len(v) // 10))
            lines.append(f"| `{task}` | {RUNS[name][3]} | {cell(ev, lambda v: f'{v:.2f}')} |")
    lines += ["", "![explained variance over training](lesson/baseline.png)", ""]

    lines += [
        "## Models in memory",
        "",
        "Each script for one step of 8 completions (8 new tokens, one micro-batch) on the same random-init "
        "Qwen2 of 25M parameters (hidden 512, 8 layers, byte-level tokenizer, hub defaults), each in a process "
        "of its own. Weights + AdamW: 16 bytes per trained parameter (float32 weights, gradients, two "
        "moments) and 4 per frozen one, computed; the peak resident memory (`perf/peak_memory_gb`) adds "
        "Python, torch and activations, measured.",
        "",
        "| script | models held | parameters held | trained | weights + AdamW, computed | peak RSS, measured |",
        "|---|---|---|---|---|---|",
        *memory_rows(runs_dir),
        "",
        END,
    ]

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is missing (pip install -r requirements/extra.txt): the figures in docs/lesson/ were NOT "
            "drawn; docs/lesson.md links to whatever is there."
        )
    else:
        os.makedirs(DOCS, exist_ok=True)
        curves(plt, runs, "charts/score", "score (10-step mean)", "fits.png", thresholds=True)
        curves(plt, runs, "losses/explained_variance", "explained variance (10-step mean)", "baseline.png")
        credit_figure(plt, example)
    page = os.path.join(REPO, "docs", "lesson.md")
    with open(page) as f:
        text = f.read()
    wrap = lambda line: line if line[:1] in ("|", "!", "<", "#") else textwrap.fill(line, 110, break_long_words=False)
    section = "\n".join(map(wrap, lines))
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S)
    else:
        text = section + "\n\n" + text  # the markers lost: the generated part goes first again
    with open(page, "w") as f:
        f.write(text)
    print(section)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", default=os.path.join(REPO, "runs", "lesson"))
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each with 2 // jobs threads)")
    parser.add_argument("--tabulate", action="store_true", help="only read the runs already made")
    parser.add_argument("--loaded", action="store_true", help="say on the page that other jobs shared the CPU")
    a = parser.parse_args()
    start = time.time()
    if not a.tabulate:
        jobs = [(name, seed) for seed in SEEDS for name in RUNS]
        with ThreadPoolExecutor(a.jobs) as pool:
            for _ in pool.map(lambda job: train(a.runs_dir, *job, max(1, 2 // a.jobs)), jobs):
                pass
        measure_memory(a.runs_dir)
        print(f"runs done in {time.time() - start:.0f} s")
    write_section(a.runs_dir, time.time() - start if not a.tabulate else None, a.loaded)


if __name__ == "__main__":
    main()
