"""The lesson's fifth row, measured on a CPU: InstructGPT-style RLHF end to end, and the over-optimisation of a
learnt reward (Gao et al. 2022, "Scaling laws for reward model overoptimization").

    OMP_NUM_THREADS=1 python benchmarks/rlhf.py      # 3 seeds: 3 reward models, 9 PPO runs, 3 GRPO runs (--jobs 2)
    python benchmarks/rlhf.py --tabulate              # only re-reads the runs already in --runs-dir

Per seed: (1) `python reward_model.py --seed S`, the default run: pairs of the tiny model's completions of the copy
prompts (the initial policy's), labelled by rewards.graded_copy_reward through Bradley-Terry noise (beta 30), a
reward model trained on them; (2) `ppo.py --reward-model RM/final` at each --kl-coef of PPO_KL_COEFS, and
`grpo.py --reward-model RM/final` (its default beta), each with --dump-dir; (3) from every step's dump: the learnt
reward (the reward model's score, what the policy is trained on), the gold reward (graded_copy_reward of the same
completions, which the policy never sees) and the KL to the reference, the completion's sum over its tokens of
log pi - log pi_ref (k1 on the sampled tokens, with the sampling policy's log-probs: PPO's old_logp, GRPO's new_logp
of its one iteration). Each curve is the mean of the seeds over windows of WINDOW steps; the figure plots gold and
learnt reward against sqrt(KL) (Gao et al.'s axes) to docs/lesson/rlhf.png (needs matplotlib).

Runs already finished in --runs-dir are kept, so a stopped benchmark continues where it was.
"""

import argparse
import glob
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
FIGURE = os.path.join(REPO, "docs", "lesson", "rlhf.png")
SEEDS = (1, 2, 3)
PPO_KL_COEFS = (0.02, 0.2, 1.0)  # 0.02: ppo.py's default; the reward model's scores span about 8 units
STEPS = {"ppo": 80, "grpo": 120}  # GRPO's steps are cheaper (no critic, one pass): about the same wall time
WINDOW = 5  # steps averaged into one point of a curve
QUICK_RM, TABULATE = [], False  # --quick: a smoke test of the whole pipeline (1 seed, a few steps); --tabulate
RUNS = {f"ppo-kl{kl:g}": ("ppo", ["--kl-coef", str(kl)], f"PPO, KL coef {kl:g}") for kl in PPO_KL_COEFS}
RUNS["grpo"] = ("grpo", [], "GRPO, beta 0.08 (k3 in the loss)")


def folder(runs_dir, name, seed):
    return os.path.join(runs_dir, f"{name}-{seed}")


def final_model(out):
    found = glob.glob(os.path.join(out, "*", "final"))
    return found[0] if found else None


def launch(out, cmd, threads):
    """One run in a subprocess, its log beside it; skipped when its final model is there. Returns its log."""
    log_path = os.path.join(out, "log.txt")
    if final_model(out) is None and TABULATE:
        sys.exit(f"--tabulate: {out} holds no finished run")
    if final_model(out) is None:
        os.makedirs(out, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        with open(log_path, "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return f.read()


def reward_model_run(runs_dir, seed, threads):
    out = folder(runs_dir, "rm", seed)
    cmd = [sys.executable, "reward_model.py", "--seed", str(seed), "--output-dir", out, *QUICK_RM]
    log = launch(out, cmd, threads)
    accuracy, seconds = re.search(r"done: \d+ steps, (\d+)s .*accuracy ([\d.]+)", log).group(2, 1)
    return dict(accuracy=float(accuracy), seconds=float(seconds))


def policy_run(runs_dir, name, seed, threads):
    script, flags, _ = RUNS[name]
    out = folder(runs_dir, name, seed)
    reward = final_model(folder(runs_dir, "rm", seed))
    cmd = [sys.executable, f"{script}.py", "--reward-model", reward, "--seed", str(seed), "--sample-every", "0"]
    cmd += ["--num-steps", str(STEPS[script]), "--output-dir", out, "--dump-dir", os.path.join(out, "dump"), *flags]
    log = launch(out, cmd, threads)
    return float(re.search(r"done: \d+ steps, (\d+)s", log).group(1))


def curves(dump_dir):
    """Per step: (learnt reward, gold reward, KL to the reference), each the mean over the step's completions, and the
    variance of that mean of the gold reward."""
    import torch
    from safetensors.torch import load_file

    from machinery import generation, models
    from machinery.tiny_model import TINY_MODEL
    from tasks import copy_task
    from tasks.rewards import graded_copy_reward

    tokenizer = models.load_tokenizer(TINY_MODEL)
    task = copy_task()
    answers = {example["prompt"]: example["answer"] for example in task.train + task.test}
    rows = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "step*.safetensors"))):
        dump = load_file(path)
        prompts = tokenizer.batch_decode(dump["prompt_ids"] * dump["prompt_mask"], skip_special_tokens=True)
        eos = [tokenizer.eos_token_id]
        texts = generation.decode_completions(tokenizer, dump["completion_ids"], dump["completion_mask"], eos)
        gold = [graded_copy_reward(p, c, answers[p]) for p, c in zip(prompts, texts)]
        logp = dump["old_logp"] if "scores" in dump else dump["new_logp"]  # PPO's rollout, GRPO's one iteration
        kl = ((logp - dump["ref_logp"]) * dump["completion_mask"]).sum(1)  # [N]
        learnt = dump["scores"] if "scores" in dump else dump["rewards"]  # PPO: the score before its penalties
        gold = torch.tensor(gold)
        rows.append((learnt.mean().item(), gold.mean().item(), kl.mean().item(), gold.var().item() / len(gold)))
    assert rows, f"no dumps in {dump_dir}"
    return torch.tensor(rows)  # [steps, 4]


def windows(rows):
    """[steps, 4] -> [steps // WINDOW, 4], the mean of each window of WINDOW steps (the variance: of that mean)."""
    n = len(rows) // WINDOW * WINDOW
    means = rows[:n].view(-1, WINDOW, rows.shape[1]).mean(1)
    means[:, 3] /= WINDOW
    return means


def measure(runs_dir, name):
    """The run's curve (mean of the seeds, per window) and each seed's figures."""
    per_seed = [windows(curves(os.path.join(folder(runs_dir, name, seed), "dump"))) for seed in SEEDS]
    figures = []
    for rows in per_seed:
        learnt, gold, kl, gold_var = rows.T
        peak = int(gold.argmax())
        figures.append(
            dict(
                gold_start=gold[0].item(),
                gold_peak=gold[peak].item(),
                kl_at_peak=kl[peak].item(),
                peak_step=(peak + 1) * WINDOW,
                gold_end=gold[-1].item(),
                learnt_start=learnt[0].item(),
                learnt_end=learnt[-1].item(),
                learnt_after_peak=(learnt[-1] - learnt[peak]).item(),
                gold_after_peak=(gold[-1] - gold[peak]).item(),
                kl_end=kl[-1].item(),
                gold_se=gold_var.mean().sqrt().item(),  # the standard error of one window's gold reward
            )
        )
    import torch

    return torch.stack(per_seed).mean(0), figures


def plot(measured, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -r requirements/extra.txt): no figure drawn")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, (curve, _) in measured.items():
        x = curve[:, 2].clamp(min=0).sqrt()
        (line,) = left.plot(x, curve[:, 1], marker=".", label=RUNS[name][2])
        right.plot(x, curve[:, 0], marker=".", color=line.get_color())
    left.set(xlabel="sqrt(KL to the reference), sqrt(nats)", ylabel="gold reward (never seen by the policy)")
    right.set(xlabel="sqrt(KL to the reference), sqrt(nats)", ylabel="learnt reward (the reward model's score)")
    left.legend(fontsize=8)
    n = len(SEEDS)
    fig.suptitle(
        f"RLHF against a learnt reward model, tiny model, copy prompts: mean of {n} seeds, {WINDOW}-step windows"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"figure: {os.path.relpath(path, REPO)}")


def span(values, fmt="{:.3f}"):
    return f"{fmt.format(statistics.mean(values))} ({fmt.format(min(values))} to {fmt.format(max(values))})"


def table(measured, rms, seconds):
    print("\nreward models (default run): held-out accuracy " + span([r["accuracy"] for r in rms]))
    print("  seconds each: " + ", ".join(f"{r['seconds']:.0f}" for r in rms))
    header = "| run | gold reward: first window, peak, last | sqrt(KL) at the gold peak, at the end |"
    header += " learnt reward: first window, last | after the gold peak: learnt, gold | seconds per run |"
    print("\n" + header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, (_, figures) in measured.items():
        get = lambda key: [f[key] for f in figures]  # noqa: E731
        root = lambda key: [max(v, 0) ** 0.5 for v in get(key)]  # noqa: E731
        cells = [
            RUNS[name][2],
            f"{span(get('gold_start'))}; {span(get('gold_peak'))}; {span(get('gold_end'))}",
            f"{span(root('kl_at_peak'), '{:.2f}')}; {span(root('kl_end'), '{:.2f}')}",
            f"{span(get('learnt_start'), '{:.2f}')}; {span(get('learnt_end'), '{:.2f}')}",
            f"{span(get('learnt_after_peak'), '{:+.2f}')}; {span(get('gold_after_peak'), '{:+.3f}')}",
            span(seconds[name], "{:.0f}"),
        ]
        print("| " + " | ".join(cells) + " |")
    se = max(f["gold_se"] for _, figures in measured.values() for f in figures)
    print("\nmean of the seeds; in brackets their lowest and highest. A window's gold reward has a standard error of")
    print(
        f"at most {se:.4f} (its completions' spread); the peak, the highest of the windows, is biased up by about that."
    )
    print("Per seed (gold reward peak at step, gold and learnt reward and sqrt(KL) at the end):")
    for name, (_, figures) in measured.items():
        for seed, f in zip(SEEDS, figures):
            print(
                f"  {RUNS[name][2]}, seed {seed}: gold peak {f['gold_peak']:.3f} at step {f['peak_step']}; end: gold "
                f"{f['gold_end']:.3f}, learnt {f['learnt_end']:.2f}, sqrt(KL) {max(f['kl_end'], 0) ** 0.5:.2f}"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", default=os.path.join(REPO, "runs", "rlhf"))
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each with 2 // jobs threads)")
    parser.add_argument("--tabulate", action="store_true", help="only read the runs already made")
    parser.add_argument("--quick", action="store_true", help="1 seed, 10 steps a run: checks the pipeline, no more")
    a = parser.parse_args()
    global SEEDS, QUICK_RM, TABULATE
    TABULATE = a.tabulate
    if a.quick:
        SEEDS, QUICK_RM = (1,), ["--num-steps", "20", "--num-pairs", "256"]
        STEPS.update(ppo=10, grpo=10)
    start, threads = time.time(), max(1, 2 // a.jobs)
    with ThreadPoolExecutor(a.jobs) as pool:  # a seed's policy runs start once its reward model is trained
        rm_futures = {seed: pool.submit(reward_model_run, a.runs_dir, seed, threads) for seed in SEEDS}
        jobs = [(name, seed) for seed in SEEDS for name in RUNS]

        def policy(name, seed):
            rm_futures[seed].result()  # submitted before any policy run: a worker is training it, or it is done
            return policy_run(a.runs_dir, name, seed, threads)

        futures = [pool.submit(policy, *job) for job in jobs]
        rms, times = [rm_futures[seed].result() for seed in SEEDS], [f.result() for f in futures]
    if not a.tabulate:
        print(f"runs done in {time.time() - start:.0f} s")
    seconds = {name: [t for (n, _), t in zip(jobs, times) if n == name] for name in RUNS}
    measured = {name: measure(a.runs_dir, name) for name in RUNS}
    table(measured, rms, seconds)
    plot(measured, os.path.join(a.runs_dir, "rlhf.png") if a.quick else FIGURE)


if __name__ == "__main__":
    main()
