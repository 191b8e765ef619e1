"""Where a GRPO step on a real model goes against this CPU's limit, and grpo.py against TRL's GRPOTrainer.
Run through benchmarks/real_model.py (its model, task and settings), on one thread:

    OMP_NUM_THREADS=1 python benchmarks/real_model.py --run speed --out runs/speed

1. The CPU's matmul throughput, float32 and bfloat16: the best of a few GEMMs of the model's shapes, one thread.
2. One GRPO step of the real-model setting, phase by phase (rollout: generate; reference: its forward; update:
   forward, backward, AdamW), in float32 and bfloat16, each group's prompt computed once (machinery/prompt_cache.py) or
   for every row, and with an empty system prompt; the variants interleaved, repeated. Each phase's matmul FLOPs are
   counted by torch's FlopCounterMode as they run (a first, untimed pass: AdamW's rate is 0 here, so the weights,
   hence the completions of a seed, are the same in every pass), and printed over its time as a share of the peak.
3. grpo.py (its default dtype, and float32) and TRL's GRPOTrainer (bf16=True, and float32) for a few steps each on
   the same settings, interleaved; seconds per step after the first.

Times are wall seconds and, beside them, the process's CPU seconds: on a machine shared with other jobs the CPU
time is what this process was given, and the share of peak is computed from it.
"""

import contextlib
import json
import os
import sys
import time

import torch

CPU = torch.device("cpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best_seconds(fn, repeats=5):
    fn()  # warm-up: oneDNN picks and caches its kernel on the first call
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def matmul_peak(dtype):
    """GFLOP/s of this thread's best GEMM at `dtype`: [2048 x 576] @ [576 x 1536] (SmolLM2's MLP), 1024^3 and the
    vocabulary head [512 x 576] @ [576 x 49152]."""
    rates = []
    for m, k, n in ((2048, 576, 1536), (1024, 1024, 1024), (512, 576, 49152)):
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        rates.append(2 * m * k * n / best_seconds(lambda: a @ b) / 1e9)
    return max(rates)


class Phases:
    """Per-phase wall and CPU seconds, or (counting=True) per-phase matmul FLOPs."""

    def __init__(self, counting):
        self.counting, self.seconds, self.cpu, self.flops = counting, {}, {}, {}

    @contextlib.contextmanager
    def __call__(self, name):
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False) if self.counting else contextlib.nullcontext()
        wall, cpu = time.perf_counter(), time.process_time()
        with counter:
            yield
        self.seconds[name] = time.perf_counter() - wall
        self.cpu[name] = time.process_time() - cpu
        if self.counting:
            self.flops[name] = counter.get_total_flops()


def grpo_step(policy, ref, tokenizer, task, examples, args, dtype, optimizer, phase):
    """grpo.py's step (num_iterations 1): the same calls on the same batch layout, timed by `phase`."""
    import common
    import grpo
    from machinery import generation, models, scoring

    eos_ids = models.eos_token_ids(policy, tokenizer)
    prompts = [ex["prompt"] for ex in examples for _ in range(args.group_size)]
    answers = [ex["answer"] for ex in examples for _ in range(args.group_size)]
    with phase("rollout"):
        with common.autocast(CPU, dtype):
            prompt_ids, prompt_mask, completion_ids, completion_mask = generation.generate(
                policy, tokenizer, prompts, args.max_new_tokens, args.temperature, eos_ids
            )
        completions = generation.decode_completions(tokenizer, completion_ids, completion_mask, eos_ids)
        rewards = scoring.score_tokens(
            task, tokenizer, prompts, completions, answers, completion_ids, completion_mask
        ).sum(1)
        advantages = grpo.group_advantages(rewards, args.group_size, args.scale_rewards)
    input_ids, attention_mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    micro = [slice(i, i + args.micro_batch_size) for i in range(0, len(prompts), args.micro_batch_size)]
    with phase("reference"), torch.no_grad(), common.autocast(CPU, dtype):
        ref_logp = torch.cat(
            [
                common.token_logprobs(ref, input_ids[m], attention_mask[m], completion_mask[m], args.temperature)
                for m in micro
            ]
        )
    with phase("update"):
        num_tokens = int(completion_mask.sum())
        for m in micro:
            with common.autocast(CPU, dtype):
                new_logp, _ = common.token_logprobs(
                    policy, input_ids[m], attention_mask[m], completion_mask[m], args.temperature, return_entropy=True
                )
            loss, _ = grpo.grpo_loss(
                new_logp,
                new_logp.detach(),
                ref_logp[m],
                advantages[m],
                completion_mask[m],
                len(prompts),
                num_tokens,
                args,
            )
            loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return dict(
        prompt_tokens=prompt_ids.shape[1], completion_tokens=completion_ids.shape[1], score=rewards.mean().item()
    )


VARIANTS = {  # name: (dtype, each group's prompt computed once, system prompt)
    "float32, per row": ("float32", False, None),
    "float32": ("float32", True, None),
    "bfloat16, per row": ("bfloat16", False, None),
    "bfloat16": ("bfloat16", True, None),
    "bfloat16, empty system prompt": ("bfloat16", True, ""),
}


QUICK = ("float32", "bfloat16, per row", "bfloat16")  # --quick: the dtype's and the shared prompt's effect


def phase_table(model_dir, task_name, settings, repeats, seed=1, variants=tuple(VARIANTS)):
    """Each variant's step: counted once, then timed `repeats` times, the variants interleaved."""
    import grpo
    from machinery import batches, models, prompt_cache
    from tasks import load_task

    args = grpo.Args(model=model_dir, task=task_name, scale_rewards="group", bias_corrected_kl=False, **settings)
    task = load_task(task_name)
    tokenizer = models.load_tokenizer(model_dir)
    policy = models.load_causal_lm(model_dir, CPU)
    ref = models.load_causal_lm(model_dir, CPU).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.0)  # the whole update's work, the weights unchanged
    examples = batches.PromptSampler(task.train, seed).sample(args.prompts_per_step)
    plain_runs = prompt_cache.prompt_runs
    results = {name: dict(runs=[]) for name in variants}
    for rep in range(repeats + 1):  # pass 0 counts the FLOPs
        for name in variants:
            dtype, shared, system_prompt = VARIANTS[name]
            prompt_cache.prompt_runs = plain_runs if shared else (lambda ids, mask: (torch.arange(len(ids)),) * 2)
            tokenizer.system_prompt = system_prompt
            phase = Phases(counting=rep == 0)
            torch.manual_seed(seed)
            info = grpo_step(policy, ref, tokenizer, task, examples, args, DTYPES[dtype], optimizer, phase)
            if rep == 0:
                results[name].update(info, flops=phase.flops)
            else:
                results[name]["runs"].append(dict(seconds=phase.seconds, cpu=phase.cpu))
            print(f"  {name}: {json.dumps(results[name]['runs'][-1] if rep else info)}", file=sys.stderr, flush=True)
    prompt_cache.prompt_runs = plain_runs
    return results


def median(values):
    values = sorted(values)
    return (
        values[len(values) // 2] if len(values) % 2 else (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2
    )


def print_phase_table(results, peaks):
    print(
        "\n| variant | prompt + new tokens | phase | matmul GFLOP | s (wall) | s (CPU) | GFLOP/s (CPU) "
        "| share of peak |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        dtype = VARIANTS[name][0]
        total = dict(wall=0.0, cpu=0.0, flops=0)
        for phase in ("rollout", "reference", "update"):
            wall = median([run["seconds"][phase] for run in r["runs"]])
            cpu = median([run["cpu"][phase] for run in r["runs"]])
            flops = r["flops"][phase]
            total["wall"] += wall
            total["cpu"] += cpu
            total["flops"] += flops
            rate = flops / cpu / 1e9
            print(
                f"| {name} | {r['prompt_tokens']} + {r['completion_tokens']} | {phase} | {flops / 1e9:.0f} "
                f"| {wall:.1f} | {cpu:.1f} | {rate:.1f} | {100 * rate / peaks[dtype]:.0f}% |"
            )
        rate = total["flops"] / total["cpu"] / 1e9
        print(
            f"| {name} | | **step** | {total['flops'] / 1e9:.0f} | {total['wall']:.1f} | {total['cpu']:.1f} "
            f"| {rate:.1f} | {100 * rate / peaks[dtype]:.0f}% |"
        )
        r["step_wall"], r["step_cpu"] = total["wall"], total["cpu"]
    base = results["float32"]
    print(
        "\nstep time against float32 (wall, CPU): "
        + ", ".join(
            f"{name} {r['step_wall'] / base['step_wall']:.2f}x, {r['step_cpu'] / base['step_cpu']:.2f}x"
            for name, r in results.items()
        )
    )
    per_row, shared = results["bfloat16, per row"], results["bfloat16"]
    print(
        "each group's prompt once against every row's (bfloat16): "
        f"wall {shared['step_wall'] / per_row['step_wall']:.2f}x, "
        f"CPU {shared['step_cpu'] / per_row['step_cpu']:.2f}x"
    )


def main(model_dir, task_name, settings, repeats=2, quick=False):
    """The phase table; benchmarks/real_model.py --run speed then runs grpo.py against TRL (against_trl)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    peaks = {name: matmul_peak(dtype) for name, dtype in DTYPES.items()}
    print("matmul peak of one thread: " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks.items()), flush=True)
    variants = QUICK if quick else tuple(VARIANTS)
    print_phase_table(phase_table(model_dir, task_name, settings, repeats, variants=variants), peaks)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
