"""GRPO (Group Relative Policy Optimization) for language models, in one file.

Shao et al. 2024, "DeepSeekMath", section 4.1. No critic: for each prompt, sample a group of G
completions, score them, and use each completion's reward standardised within its group as the
advantage of every one of its tokens. The loss is the PPO-clip surrogate plus a k3 KL term to a
frozen reference model.

    python grpo.py                                                   # tiny model, copy task, CPU, ~1.5 min
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k   # a hub model gets its own preset
    python grpo.py --scale-rewards none --loss-agg seq-mean-token-sum-norm   # Dr. GRPO
    python grpo.py --clip-high 0.28 --loss-agg token-mean                   # DAPO's clip-higher + token mean
    python grpo.py --importance-level sequence --clip-low 3e-4 --clip-high 4e-4   # GSPO

Where this departs from the paper:
  1. With num_iterations = 1 (the default) the old policy is the current one, so the ratio is 1 and the
     clip never acts; the old log-probs are only computed, once per step, when num_iterations > 1.
  2. The reward std has an eps of 1e-4 added, so an all-equal group gets advantage 0, not NaN.
  3. The log-probs use logits divided by the sampling temperature, the distribution that sampled.
  4. --scale-rewards, --loss-agg and --importance-level switch in the Dr. GRPO, DAPO and GSPO variants.
"""

import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import tyro
from tqdm import tqdm

import bookkeeping
import common
from common import UsageError
from tasks import PromptSampler, RewardModel, load_task


@dataclass
class Args(bookkeeping.RunArgs):
    """GRPO (see the top of grpo.py). The first flags, for data, precision, checkpoints and logs, are shared with ppo.py."""

    exp_name: str = "grpo"
    """name of this experiment, part of the run folder's name"""
    seed: int = 1
    """seed of Python, numpy, torch and the prompt order"""
    model: str = common.TINY_MODEL
    """hub id or local folder of a causal LM; `tiny` is the built-in ~1M-parameter model"""
    task: str = "copy"
    """task to train on (see tasks.py)"""
    preset: Optional[Literal["tiny", "hub"]] = None
    """which column of PRESETS fills the unset fields: `tiny` for the tiny model, `hub` for any other"""
    num_steps: Optional[int] = None
    """training steps; each samples prompts_per_step * group_size completions"""
    prompts_per_step: Optional[int] = None
    """distinct prompts per step"""
    group_size: Optional[int] = None
    """completions per prompt (G), the group the advantage is standardised over"""
    max_new_tokens: Optional[int] = None
    """longest completion, in tokens"""
    temperature: float = 1.0
    """sampling temperature; the log-probs are computed at the same temperature"""
    learning_rate: Optional[float] = None
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled), on every weight; 0 as in TRL and OpenRLHF (verl uses 0.01)"""
    warmup_steps: int = 0
    """steps of linear learning-rate warmup from 0"""
    max_grad_norm: float = 1.0
    """gradients are clipped to this global norm"""
    num_iterations: int = 1
    """optimizer steps on each batch (mu in the paper)"""
    clip_low: float = 0.2
    """the ratio is clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """the ratio is clipped above at 1 + clip_high (DAPO's clip-higher uses 0.28)"""
    beta: Optional[float] = None
    """coefficient of the k3 KL term to the reference; 0 loads no reference model"""
    scale_rewards: Optional[Literal["group", "batch", "none"]] = None
    """divide (r - group mean) by the group's std (paper), the batch's std, or nothing (Dr. GRPO)"""
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """how per-token losses become one number: GRPO paper, DAPO, or Dr. GRPO"""
    bias_corrected_kl: bool = False
    """weight the k3 term by the importance ratio (TRL's default, DeepSeek-V3.2): same value, its gradient gains kl * grad log p"""
    importance_level: Literal["token", "sequence"] = "token"
    """one ratio per token (PPO, GRPO) or one per completion, the geometric mean (GSPO)"""
    micro_batch_size: Optional[int] = None
    """completions per forward/backward pass; the gradient is that of the whole batch"""


# Defaults for the fields left unset. A real model must never get the tiny model's learning rate.
# The tiny model starts from random weights, so its reference is near uniform and beta * KL acts as an
# entropy bonus: without it the policy turns deterministic at ~0.8 reward and stops exploring.
PRESETS = {
    "tiny": dict(num_steps=600, prompts_per_step=16, group_size=8, max_new_tokens=5, learning_rate=5e-4,
                 beta=0.04, scale_rewards="batch", micro_batch_size=128),
    "hub": dict(num_steps=500, prompts_per_step=16, group_size=8, max_new_tokens=512, learning_rate=1e-6,
                beta=0.04, scale_rewards="group", micro_batch_size=8),
}  # fmt: skip


def check_args(args):
    if args.group_size < 2:
        raise UsageError(f"--group-size is {args.group_size}: GRPO needs at least 2 completions per prompt")
    for name in ("prompts_per_step", "max_new_tokens", "num_steps", "num_iterations", "micro_batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} is {getattr(args, name)}: it must be at least 1")
    if args.temperature <= 0:
        raise UsageError(f"--temperature is {args.temperature}: it must be > 0 (the log-probs divide by it)")
    if not 0 <= args.clip_low < 1 or args.clip_high < 0:
        raise UsageError(f"--clip-low {args.clip_low} --clip-high {args.clip_high}: need 0 <= clip-low < 1 and clip-high >= 0")
    if args.beta < 0 or args.learning_rate <= 0 or args.warmup_steps < 0 or args.max_grad_norm <= 0:
        raise UsageError("--beta and --warmup-steps must be >= 0, --learning-rate and --max-grad-norm > 0")
    for name in ("eval_every", "save_every", "sample_every"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} is {getattr(args, name)}: use 0 for never, or a positive number of steps")


def group_advantages(rewards, group_size, scale, eps=1e-4):
    """GRPO's outcome advantage (DeepSeekMath, eq. in section 4.1.2): A_i = (r_i - mean(group)) / (std + eps).

    rewards: [N], laid out group by group (N = num_groups * group_size). Returns [N].
      scale="group": std of the completion's own group (the paper; torch's unbiased std)
      scale="batch": std of all N rewards (more robust when a group is nearly constant)
      scale="none":  no division (Dr. GRPO, Liu et al. 2025: the std biases towards easy/hard prompts)
    A group whose rewards are all equal gets advantage 0: there is nothing to learn from it.
    """
    grouped = rewards.view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = advantages / (rewards.std() + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'group', 'batch' or 'none', not {scale!r}")
    return advantages.view(-1)


def main(args):
    preset = bookkeeping.apply_preset(args, PRESETS)
    check_args(args)
    common.check_model_names(args, ["model", "reward_model"])
    task = load_task(args.task)
    device = common.pick_device()
    dtype = common.resolve_dtype(args.dtype, device)
    resume = bookkeeping.load_checkpoint(args.resume, "grpo", args) if args.resume else None
    run_dir = os.path.dirname(os.path.abspath(args.resume)) if resume else os.path.join(args.output_dir, bookkeeping.run_name(args))
    bookkeeping.print_settings(args, f"preset {preset}, run {run_dir}")

    bookkeeping.seed_everything(args.seed, args.deterministic)
    start_time = time.time()
    policy_path = os.path.join(args.resume, "policy") if resume else args.model
    tokenizer = common.load_tokenizer(policy_path)
    policy = common.load_causal_lm(policy_path, device)  # float32 master weights, autocast to dtype
    if args.gradient_checkpointing:
        common.set_activation_checkpointing(policy, True)
    # The reference only enters the loss through beta * KL; with beta = 0 it is not even loaded. It is held like
    # the policy (float32 weights, the same autocast), so at step 1 the two compute the same log-probs: KL 0.
    ref_model = common.load_causal_lm(args.model, device).eval().requires_grad_(False) if args.beta > 0 else None
    scorer = RewardModel(args.reward_model, device, dtype) if args.reward_model else task
    common.check_vocabulary(tokenizer, task, args.model)
    common.check_prompt_length(tokenizer, task, policy, args.model, args.max_new_tokens, args.chat_template)
    eos_ids = common.eos_token_ids(policy, tokenizer)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (args.warmup_steps + 1)))
    sampler = PromptSampler(task.train, args.seed)
    first_step, history = bookkeeping.restore_state(resume, optimizer, scheduler, sampler, {"score": [], "length": [], "tokens": 0})
    writer = bookkeeping.make_writer(run_dir, args, purge_step=first_step)
    if not resume:  # step 0 is logged once, so a resumed run's log is the uninterrupted run's
        writer.add_scalar("charts/params_policy", common.count_parameters(policy), 0)
        writer.add_scalar("charts/params_reference", common.count_parameters(ref_model) if ref_model else 0, 0)
    if args.dump_dir:
        bookkeeping.write_dump_metadata(args.dump_dir, "grpo", args)
    checkpoint_dir = os.path.join(run_dir, "checkpoint")
    save_checkpoint = lambda step: bookkeeping.save_checkpoint(  # noqa: E731
        checkpoint_dir, "grpo", args, {"policy": policy}, tokenizer,
        dict(step=step, optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(), sampler=sampler.state_dict(), history=history),
    )  # fmt: skip
    stop = bookkeeping.StopSignal()
    timer = bookkeeping.Timer()

    pbar = tqdm(range(first_step, args.num_steps + 1), desc="grpo", dynamic_ncols=True, initial=first_step - 1, total=args.num_steps)
    for step in pbar:
        # ROLLOUT: G completions for each prompt, laid out group by group.
        with timer("rollout"):
            examples = sampler.sample(args.prompts_per_step)
            prompts = [ex["prompt"] for ex in examples for _ in range(args.group_size)]
            answers = [ex["answer"] for ex in examples for _ in range(args.group_size)]
            with common.autocast(device, dtype):
                prompt_ids, prompt_mask, completion_ids, completion_mask = common.generate(
                    policy, tokenizer, prompts, args.max_new_tokens, args.temperature, eos_ids, chat_template=args.chat_template
                )
            completions = common.decode_completions(tokenizer, completion_ids, completion_mask, eos_ids)
            rewards = torch.tensor(scorer.score(prompts, completions, answers), device=device)  # [N]

            # ALGO LOGIC: the advantage is the reward standardised within its group, shared by all its tokens.
            advantages = group_advantages(rewards, args.group_size, args.scale_rewards)  # [N]

            b_input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P + T]
            b_attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            b_mask = completion_mask  # [N, T]
            N, num_tokens = len(prompts), int(b_mask.sum())
            mb_slices = [slice(i, i + args.micro_batch_size) for i in range(0, N, args.micro_batch_size)]
            with torch.no_grad(), common.autocast(device, dtype):
                forward = lambda model, mb: common.token_logprobs(  # noqa: E731
                    model, b_input_ids[mb], b_attention_mask[mb], b_mask[mb], args.temperature
                )
                # mu > 1: the policy moves between iterations, so freeze the sampling policy's log-probs now.
                b_old_logp = torch.cat([forward(policy, mb) for mb in mb_slices]) if args.num_iterations > 1 else None
                b_ref_logp = torch.cat([forward(ref_model, mb) for mb in mb_slices]) if ref_model else None
            dump = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids, completion_mask=b_mask,
                        rewards=rewards, advantages=advantages)  # fmt: skip
            if b_ref_logp is not None:
                dump["ref_logp"] = b_ref_logp
            bookkeeping.check_finite(step, "reward", rewards, run_dir, dump)

        # OPTIMIZE: num_iterations steps on the whole batch, accumulated over micro-batches.
        with timer("train"):
            policy.train()
            stats = {k: 0.0 for k in ("policy_loss", "approx_kl", "clipfrac", "kl_ref", "entropy")}
            for iteration in range(args.num_iterations):
                optimizer.zero_grad(set_to_none=True)
                dump.update(old_logp=[], new_logp=[], per_token_loss=[], loss=0.0)  # this iteration's
                for mb in mb_slices:
                    mb_mask = b_mask[mb]
                    with common.autocast(device, dtype):
                        new_logp, entropy = common.token_logprobs(
                            policy, b_input_ids[mb], b_attention_mask[mb], mb_mask, args.temperature, return_entropy=True
                        )  # [n, T]
                    old_logp = b_old_logp[mb] if b_old_logp is not None else new_logp.detach()
                    logratio = new_logp - old_logp  # [n, T]
                    if args.importance_level == "sequence":
                        # GSPO (Zheng et al. 2025): one ratio per completion, exp(mean_t logratio), on every token.
                        logratio = common.masked_mean(logratio, mb_mask, dim=1)[:, None].expand_as(logratio)
                    mb_advantages = advantages[mb, None]  # [n, 1]
                    pg_loss = common.clipped_policy_loss(logratio, mb_advantages, args.clip_low, args.clip_high)
                    per_token_loss = pg_loss
                    if ref_model is not None:
                        # The KL to the reference enters the loss (not the reward), by the k3 estimator.
                        kl_ref = common.kl_estimate(new_logp, b_ref_logp[mb], "k3")
                        if args.bias_corrected_kl:  # k3 * ratio: an unbiased KL gradient under samples of the old policy
                            kl_ref = kl_ref * torch.exp(logratio)
                        per_token_loss = pg_loss + args.beta * kl_ref
                    loss = common.aggregate_loss(per_token_loss, mb_mask, args.loss_agg, N, num_tokens, args.max_new_tokens)
                    dump["old_logp"].append(old_logp)
                    dump["new_logp"].append(new_logp.detach())
                    dump["per_token_loss"].append(per_token_loss.detach() * mb_mask)
                    dump["loss"] += loss.item()
                    bookkeeping.check_finite(step, "loss", loss.detach(), run_dir, dump)
                    loss.backward()

                    weight = int(mb_mask.sum()) / max(num_tokens, 1) / args.num_iterations  # mean over all updates, as in ppo.py
                    with torch.no_grad():
                        stats["policy_loss"] += common.masked_mean(pg_loss, mb_mask).item() * weight
                        if ref_model is not None:
                            stats["kl_ref"] += common.masked_mean(kl_ref, mb_mask).item() * weight
                        stats["approx_kl"] += common.approx_kl(logratio, mb_mask).item() * weight
                        stats["clipfrac"] += common.clip_fraction(logratio, mb_advantages, args.clip_low, args.clip_high, mb_mask).item() * weight
                        stats["entropy"] += common.masked_mean(entropy, mb_mask).item() * weight
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
                bookkeeping.check_finite(step, "gradient", grad_norm, run_dir, dump)
                optimizer.step()
        if args.dump_dir:
            bookkeeping.dump_batch(os.path.join(args.dump_dir, f"step{step:06d}.safetensors"), dump)

        # LOGGING: the same names in grpo.py and ppo.py.
        history["tokens"] += int(b_attention_mask.sum())
        score_mean = rewards.mean().item()  # GRPO's reward is the task score: its KL is in the loss, not the reward
        history["score"].append(score_mean)
        lengths = b_mask.sum(1).float()
        history["length"].append(lengths.mean().item())
        writer.add_scalar("charts/reward", score_mean, step)
        writer.add_scalar("charts/score", score_mean, step)
        writer.add_scalar("charts/reward_std", rewards.std().item(), step)
        writer.add_scalar("charts/completion_length", lengths.mean().item(), step)
        writer.add_scalar("charts/learning_rate", optimizer.param_groups[0]["lr"], step)
        scheduler.step()  # after logging the rate this step's updates used
        for key, value in stats.items():
            if key != "kl_ref" or ref_model is not None:
                writer.add_scalar(f"losses/{key}", value, step)
        writer.add_scalar("losses/grad_norm", grad_norm.item(), step)
        bookkeeping.log_perf(writer, step, timer, history["tokens"], device)
        pbar.set_postfix(score=f"{score_mean:.3f}", len=f"{lengths.mean().item():.1f}")
        if args.sample_every and (step % args.sample_every == 0 or step == 1):
            for i in range(0, min(N, 3 * args.group_size), args.group_size):
                tqdm.write(f"step {step} | {prompts[i]!r} -> {completions[i]!r} | score {rewards[i].item():.2f}")
        if args.eval_every and step % args.eval_every == 0:
            with common.autocast(device, dtype):
                metrics = common.evaluate(policy, tokenizer, task, args.max_new_tokens, eos_ids, args.chat_template)
            for key, value in metrics.items():
                writer.add_scalar(key, value, step)
        if stop.name or (args.save_every and step % args.save_every == 0):
            save_checkpoint(step)
        if stop.name:
            writer.close()
            raise SystemExit(f"stopped by {stop.name} after step {step}; resume with: {bookkeeping.resume_command('grpo', checkpoint_dir)}")

    final_dir = os.path.join(run_dir, "final")
    bookkeeping.save_model(policy, tokenizer, final_dir)
    writer.close()
    bookkeeping.print_summary("grpo", history, time.time() - start_time, device, final_dir)
    return history["score"]


if __name__ == "__main__":
    bookkeeping.run_main(lambda: main(tyro.cli(Args)))
