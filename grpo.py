"""GRPO (Group Relative Policy Optimization) for language models, in one file.

Shao et al. 2024, "DeepSeekMath", section 4.1. No critic: for each prompt, sample a group of G
completions, score them (a dense reward counts as its sum), and use each completion's reward
standardised within its group as the advantage of every one of its tokens. The loss is the PPO-clip
surrogate plus a k3 KL term to a frozen reference model.

    python grpo.py                                                   # tiny model, copy task, CPU, ~2 min
    python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k   # a hub model gets HUB_DEFAULTS
    python grpo.py --model Qwen/Qwen2.5-7B-Instruct --task gsm8k --lora-rank 16 --learning-rate 1e-5   # LoRA, one GPU
    python grpo.py --scale-rewards none --loss-agg seq-mean-token-sum-norm   # Dr. GRPO
    python grpo.py --clip-high 0.28 --loss-agg token-mean                   # DAPO's clip-higher + token mean
    python grpo.py --importance-level sequence --clip-low 3e-4 --clip-high 4e-4   # GSPO

Where this departs from the paper:
  1. With num_iterations = 1 (the default) the old policy is the current one, so the ratio is 1 and the
     clip never acts; the old log-probs are only computed, once per step, when num_iterations > 1.
  2. The reward std has an eps of 1e-4 added (--adv-eps), so an all-equal group gets advantage 0, not NaN.
  3. The log-probs use logits divided by the sampling temperature, the distribution that sampled.
  4. --scale-rewards, --loss-agg and --importance-level switch in the Dr. GRPO, DAPO and GSPO variants.
  5. The default run divides the advantages by the std of the whole batch's rewards (--scale-rewards batch),
     not each group's: the tiny model's groups of 8 are often nearly constant. HUB_DEFAULTS use the group's.
  6. The default run's beta (0.08) is an entropy pull, not a leash to a fine-tuned model: the tiny model starts
     from random weights, so its reference is near uniform; without beta * KL it turns deterministic at ~0.8.
  7. The default run weights the k3 term by the importance ratio (--bias-corrected-kl, TRL's default, as in
     DeepSeek-V3.2): same value, its gradient gains kl * grad log p. With both, 10 of 10 seeds end >= 0.996;
     beta 0.04: seeds 1 and 3 ended at 0.79-0.90; the paper's k3: 0.95-0.96. HUB_DEFAULTS: the paper's.
"""

import functools
import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

import common
from machinery import batches, bookkeeping, checkpoints, dumps, flags, gold, lora, models, startup
from machinery import distributed as dist  # torchrun support (machinery/distributed.py): identities on one process
from machinery.flag_checks import check_grpo_args
from machinery.tiny_model import TINY_MODEL
from tasks import load_task


@dataclass
class Args(flags.RunArgs):
    """GRPO (see the top of grpo.py); the first flags (data, precision, checkpoints, logs) are shared with ppo.py.
    The defaults are the built-in tiny model's; on any other model, HUB_DEFAULTS replace some of them."""

    # Shared with the other algorithm file: the same names, meanings and (but for the sizes) defaults.
    exp_name: str = "grpo"
    """name of this experiment, part of the run folder's name"""
    seed: int = 1
    """seed of Python, numpy, torch and the prompt order"""
    model: str = TINY_MODEL
    """hub id, local folder or .gguf file of a causal LM; `tiny` is the built-in ~1M-parameter model"""
    task: str = "copy"
    """task to train on (see tasks/__init__.py)"""
    preset: Optional[Literal["tiny", "hub"]] = None
    """`hub` applies HUB_DEFAULTS to the fields left at their default (by default: on any model but tiny)"""
    num_steps: int = 600
    """training steps; each samples prompts_per_step * group_size completions"""
    prompts_per_step: int = 16
    """distinct prompts per step"""
    max_new_tokens: int = 5
    """longest completion, in tokens"""
    temperature: float = 1.0
    """sampling temperature; the log-probs are computed at the same temperature"""
    learning_rate: float = 5e-4
    """AdamW learning rate of the policy"""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled), of every trained model; 0 as in TRL and OpenRLHF (verl uses 0.01)"""
    decay_norms_and_biases: bool = True
    """weight decay on biases and norm weights too; --no-decay-norms-and-biases spares them, as the HF Trainer
    (TRL) does"""
    warmup_steps: int = 0
    """steps of linear learning-rate warmup from 0"""
    max_grad_norm: float = 1.0
    """the gradients of each trained model are clipped to this global norm"""
    clip_low: float = 0.2
    """the ratio is clipped below at 1 - clip_low"""
    clip_high: float = 0.2
    """the ratio is clipped above at 1 + clip_high (DAPO's clip-higher uses 0.28)"""
    micro_batch_size: int = 128
    """completions per forward/backward pass; the gradient is that of the whole batch an optimizer step takes"""
    # GRPO's own: the group, the KL term in the loss and the variants (Dr. GRPO, DAPO, GSPO).
    group_size: int = 8
    """completions per prompt (G), the group the advantage is standardised over"""
    num_iterations: int = 1
    """optimizer steps on each batch (mu in the paper); at 1 every ratio is 1: GMPO-like variants are no-ops"""
    beta: float = 0.08
    """coefficient of the k3 KL term to the reference; 0 loads no reference model"""
    scale_rewards: Literal["group", "batch", "none"] = "batch"
    """divide (r - group mean) by the group's std (paper), the batch's std, or nothing (Dr. GRPO)"""
    adv_eps: float = 1e-4
    """added to that std (TRL 1e-4, verl 1e-6, OpenRLHF 1e-9): a peer's value makes a dump it matches exactly"""
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    """how per-token losses become one number: GRPO paper, DAPO, or Dr. GRPO"""
    bias_corrected_kl: bool = True
    """weight the k3 term by the importance ratio (TRL's default, DeepSeek-V3.2): same value, its gradient gains
    kl * grad log p; an unbiased KL gradient under --importance-level token only (sequence: one ratio on all)"""
    importance_level: Literal["token", "sequence"] = "token"
    """one ratio per token (PPO, GRPO) or one per completion, the geometric mean (GSPO)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: train only on groups whose rewards differ, sampling more prompts to fill the batch"""
    max_sampling_rounds: int = 3
    """with --dynamic-sampling, rounds of prompts_per_step prompts sampled at most per step"""


# On a model other than tiny, these replace the defaults above (a real model must never get the tiny model's
# learning rate); a flag given on the command line wins. Printed at start.
HUB_DEFAULTS = dict(num_steps=500, max_new_tokens=512, learning_rate=1e-6, micro_batch_size=8)  # sizes and rate
HUB_DEFAULTS.update(scale_rewards="group", beta=0.04, bias_corrected_kl=False)  # the paper's GRPO (departures 5-7)
SCRIPT = "grpo"  # names its checkpoints, dumps and logs
DUMPED = ("old_logp", "new_logp", "per_token_loss")  # what a dump keeps of the last iteration, beside the rollout
LOADERS = {"policy": models.load_causal_lm}  # what --resume builds each trained model's checkpoint into
LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")  # --loss-agg, aggregate_loss
check_args = check_grpo_args  # each flag's range, and what it needs to act (machinery/flag_checks.py)


def informative_groups(rewards, group_size):
    """[groups] bool: the groups whose rewards differ (an all-equal group has advantage 0 on every token)."""
    return rewards.view(-1, group_size).std(1) > 0


def dynamic_sampling(sample, args, stopped=lambda: False):
    """DAPO's dynamic sampling (Yu et al. 2025, section 3.2): a group whose rewards are all equal has advantage 0
    on every token and only dilutes the batch, so sample more rounds until prompts_per_step groups have rewards
    that differ, then keep those. After --max-sampling-rounds the batch is filled with equal-reward groups, so
    every step has the same size (and, under torchrun, every process the same number of micro-batches); so it is
    after a signal (`stopped()`, asked between rounds): the step ends, and the run saves and stops.
    Returns the batch and the number of rounds sampled."""
    batch, n_groups, rounds = sample(), args.prompts_per_step // dist.world_size(), 1
    while rounds < args.max_sampling_rounds and not stopped():
        found = int(informative_groups(batch["scores"], args.group_size).sum())
        if not dist.any(found < n_groups):  # no process lacks some
            break
        batch, rounds = batches.concat_batches(batch, sample()), rounds + 1
    informative = informative_groups(batch["scores"], args.group_size)  # [groups]
    groups = torch.cat([informative.nonzero()[:, 0], (~informative).nonzero()[:, 0]])[:n_groups]  # informative first
    rows = (groups[:, None] * args.group_size + torch.arange(args.group_size)).view(-1)  # [N]
    return common.select_rows(batch, rows), rounds


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


def setup_state(sample, models, args):
    """State measured once before the first step, carried by the checkpoint and put in every batch (ppo.py's says
    how; docs/fork.md): `sample()` draws a round of scored completions, `models` holds the models. GRPO has none."""
    return {}


def compute_advantages(batch, args):
    """The advantage of every completion, [N], from a batch of whole groups (batch["rewards"], [N]): the one
    entry point the training loop and verify.py's self-check call. A new advantage goes here."""
    return group_advantages(batch["rewards"], args.group_size, args.scale_rewards, args.adv_eps)


def clipped_policy_loss(logratio, advantages, clip_low, clip_high):
    """Per-token PPO-clip surrogate loss (Schulman et al. 2017, eq. 7) as GRPO uses it, a loss to minimise:

      ratio = exp(logratio),  logratio = logp - old_logp    (GSPO: the completion's mean logratio)
      loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))

    A is the completion's advantage [n, 1], the same on all its tokens. clip_low != clip_high is DAPO's
    "clip-higher" (Yu et al. 2025).
    """
    ratio = torch.exp(logratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.max(pg_loss1, pg_loss2)


def aggregate_loss(loss, mask, agg, total_seqs, total_tokens, max_new_tokens):
    """Reduce a per-token loss [b, T] of one micro-batch to its share of the whole-batch loss.

    The denominators are those of the whole batch (`total_seqs` sequences, `total_tokens` real tokens),
    so summing the results over micro-batches gives exactly the one-batch loss, and its gradient.
      seq-mean-token-mean      mean over each sequence's tokens, then over sequences (GRPO paper)
      token-mean               every real token in the batch weighs the same (DAPO, Yu et al. 2025)
      seq-mean-token-sum-norm  sum over tokens / (sequences * max_new_tokens), a constant (Dr. GRPO,
                               Liu et al. 2025), so no length bias enters through the normaliser
    """
    mask = mask.to(loss.dtype)
    if agg == "seq-mean-token-mean":
        return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / total_seqs
    if agg == "token-mean":
        return (loss * mask).sum() / max(total_tokens, 1)
    if agg == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / (total_seqs * max_new_tokens)
    raise ValueError(f"agg must be one of {LOSS_AGGREGATIONS}, not {agg!r}")


def grpo_loss(new_logp, old_logp, ref_logp, advantages, mask, total_seqs, total_tokens, args):
    """GRPO's loss on one micro-batch (DeepSeekMath eq. 3), as its share of the whole batch's loss.

      ratio_t = exp(logp_t - old_logp_t)              GSPO: exp(mean_t (logp_t - old_logp_t)) on every token
      L_t     = max(-A ratio_t, -A clip(ratio_t, 1 - clip_low, 1 + clip_high)) + beta * k3_t
      k3_t    = ref_t / p_t - 1 - log(ref_t / p_t)    Schulman's k3 of KL(policy || ref); times ratio_t with
                                                      --bias-corrected-kl (an unbiased KL gradient only with
                                                      the token's own ratio, not GSPO's sequence one)
      loss    = aggregate_loss(L) with the batch's total_seqs sequences and total_tokens real tokens

    new_logp [n, T] carries the gradient; old_logp and ref_logp [n, T] (None when beta = 0) and advantages [n]
    do not. Returns the loss and, detached, every per-token tensor of the micro-batch (for dumps and logs), with the
    tokens whose gradient the clip cut off (`clipped`: losses/clipfrac and verify's notes read it).
    """
    logratio = new_logp - old_logp  # [n, T]
    if args.importance_level == "sequence":
        # GSPO (Zheng et al. 2025): one ratio per completion, exp(mean_t logratio), on every token.
        logratio = common.masked_mean(logratio, mask, dim=1)[:, None].expand_as(logratio)
    pg_loss = clipped_policy_loss(logratio, advantages[:, None], args.clip_low, args.clip_high)  # [n, T]
    per_token_loss, kl_ref = pg_loss, None
    if ref_logp is not None:
        # The KL to the reference enters the loss (not the reward), by the k3 estimator.
        log_r = ref_logp - new_logp
        kl_ref = torch.exp(log_r) - 1 - log_r  # [n, T]
        # k3 * ratio: an unbiased KL gradient under samples of the old policy, with each token's own ratio;
        # GSPO's sequence ratio on every token is not (TRL says the same of importance_sampling_level).
        if args.bias_corrected_kl:
            kl_ref = kl_ref * torch.exp(logratio)
        per_token_loss = pg_loss + args.beta * kl_ref
    loss = aggregate_loss(per_token_loss, mask, args.loss_agg, total_seqs, total_tokens, args.max_new_tokens)
    terms = dict(
        new_logp=new_logp,
        old_logp=old_logp,
        advantages=advantages[:, None],
        mask=mask,
        logratio=logratio,
        pg_loss=pg_loss,
        kl_ref=kl_ref,
        clipped=common.clipped_tokens(logratio, advantages[:, None], args.clip_low, args.clip_high),  # clipfrac's
        per_token_loss=per_token_loss * mask,
        loss=loss,
    )
    return loss, {key: value.detach() for key, value in terms.items() if value is not None}


def compute_loss(outputs, batch, args):
    """The loss entry point the training loop and verify.py's self-check call: grpo_loss on a (micro-)batch of the
    dump's names (old_logp None when num_iterations = 1: ratio 1; ref_logp absent when beta = 0; num_seqs and
    num_tokens: the whole batch's), from the policy's outputs (new_logp). A new loss term goes here."""
    new_logp, old_logp = outputs["new_logp"], batch.get("old_logp")
    old_logp = new_logp.detach() if old_logp is None else old_logp
    ref_logp, advantages, mask = batch.get("ref_logp"), batch["advantages"], batch["completion_mask"]
    return grpo_loss(new_logp, old_logp, ref_logp, advantages, mask, batch["num_seqs"], batch["num_tokens"], args)


def main(args, flags_given=()):
    # SETUP: every flag, model name, the task, the checkpoint and the memory bound checked before anything loads.
    run = startup.start(SCRIPT, args, HUB_DEFAULTS, flags_given, check_args, load_task)
    task, device, dtype, run_dir = run.task, run.device, run.dtype, run.run_dir
    tokenizer, policy = startup.load_policy(args, device)  # float32 master weights; --lora-rank: adapters
    trained = {"policy": policy}
    # The reference only enters through beta * KL in the loss (beta 0: not loaded). Held like the policy (float32, the
    # same autocast), so the step-1 KL is 0; with LoRA it is the policy with its adapters off, no second copy.
    ref_model = lora.reference(policy, args, device) if args.beta > 0 else None
    scorer, eos_ids = startup.load_scorer(args, run, tokenizer, policy)
    sampler = batches.PromptSampler(task.train, args.seed)
    # DISTRIBUTED (torchrun): each process holds a shard of each model; the rest reads as on one.
    policy, ref_model = dist.shard(policy, ref_model)
    sample = functools.partial(  # ROLLOUT's one round: this process's prompts and their completions
        common.sample_round, sampler, policy, tokenizer, scorer, args.group_size, args, device, dtype, eos_ids
    )
    lrs = {"policy": args.learning_rate}
    optimizer, scheduler = startup.make_optimizer(trained, lrs, args, common.adamw_param_groups)
    first_step, history = startup.resume(args, run, trained, optimizer, scheduler, sampler, LOADERS)
    setup = run.state.get("setup", {}) if args.resume else setup_state(sample, dict(trained, reference=ref_model), args)
    writer = bookkeeping.make_writer(run_dir, args, first_step, **trained, reference=ref_model)
    checkpoint_dir = os.path.join(run_dir, "checkpoint")
    stop = checkpoints.StopSignal(checkpoint_dir)
    timer = bookkeeping.Timer()

    pbar = bookkeeping.progress(SCRIPT, first_step, args.num_steps)
    for step in pbar:
        # ROLLOUT: G completions for each prompt, laid out group by group (under torchrun: this process's prompts).
        with timer("rollout"):
            sampled, rounds = dynamic_sampling(sample, args, stop.requested) if args.dynamic_sampling else (sample(), 1)
            scores, b_mask = sampled["scores"], sampled["completion_mask"]  # [N], [N, T]
            inputs = batches.model_inputs(sampled)  # input_ids, attention_mask [N, P + T], completion_mask [N, T]
            N, num_tokens = len(scores), dist.sum(int(b_mask.sum()))  # num_tokens: of every process's batch
            with torch.no_grad(), common.autocast(device, dtype):  # computed once, before any update
                # mu > 1: the policy moves between iterations, so freeze the sampling policy's log-probs now.
                b_old_logp = common.rollout_logprobs(policy, inputs, args) if args.num_iterations > 1 else None
                b_ref_logp = common.rollout_logprobs(ref_model, inputs, args) if ref_model else None

            # ALGO LOGIC: the advantage is the reward standardised within its group, shared by all its tokens.
            all_scores = dist.gather(scores)  # every process's scores (one process: `scores`), for the std and logs
            b_rollout = dict(batches.batch_inputs(sampled, setup), rewards=scores)  # GRPO's reward is the score
            b_rollout.update(old_logp=b_old_logp, ref_logp=b_ref_logp)
            # Each entry point gets its batch from common.entry_batch, as verify gives it (all processes' rewards).
            tensors = dict(b_rollout, rewards=all_scores)
            advantages = compute_advantages(common.entry_batch("compute_advantages", tensors), args)
            b_rollout["advantages"] = advantages[dist.rows(N)]  # [N], this process's rows

        # OPTIMIZE: num_iterations optimizer steps, each on the whole batch in order, accumulated over micro-batches.
        with timer("train"):
            for model in trained.values():
                model.train()
            minibatches = [torch.arange(N, device=device)] * args.num_iterations  # each optimizer step: the whole batch
            updates = []  # per optimizer step, each micro-batch's terms: checked, dumped and logged below
            for mb_inds in minibatches:
                mb_batch = dict(b_rollout, num_seqs=len(all_scores), num_tokens=num_tokens)  # under torchrun: all's
                optimizer.zero_grad(set_to_none=True)
                updates.append([])
                for micro in mb_inds.split(args.micro_batch_size):
                    # The micro-batch's input_ids, attention_mask [n, P + T] and completion_mask [n, T].
                    mb_inputs = [x[micro] for x in inputs]
                    with common.autocast(device, dtype):
                        new_logp, entropy = common.token_logprobs(
                            policy, *mb_inputs, args.temperature, return_entropy=True
                        )  # [n, T]
                    outputs = dict(new_logp=new_logp)
                    micro_batch = common.entry_batch("compute_loss", common.select_rows(mb_batch, micro))
                    loss, terms = compute_loss(outputs, micro_batch, args)
                    loss.backward()
                    updates[-1].append(dict(terms, entropy=entropy))
                grad_norms = common.clip_grad_norms(trained, args.max_grad_norm)  # each model's own
                dump = dumps.batch_dump(b_rollout, updates[-1], DUMPED)  # the last iteration's is written
                dumps.stop_if_not_finite(step, run_dir, dump, scores, updates[-1], sum(grad_norms.values()))
                optimizer.step()
        dumps.dump_step(args.dump_dir, step, dump)  # with --dump-dir

        # LOGGING: the same names in grpo.py and ppo.py. Under torchrun, over every process's completions and tokens.
        lengths = bookkeeping.record(history, sampled, all_scores, pbar)  # the score: GRPO's reward (KL: in the loss)
        groups = all_scores.view(-1, args.group_size)  # [prompts, G]
        baseline = groups.mean(1).repeat_interleave(args.group_size)  # the group mean, [N]
        scalars = {
            "charts/score": history["score"][-1],
            "charts/reward_std": all_scores.std(),
            "charts/sampled_completions": rounds * args.prompts_per_step * args.group_size,
            "charts/informative_groups": (groups.std(1) > 0).float().mean(),
            "charts/completion_length": lengths.mean(),
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            "losses/explained_variance": common.explained_variance(baseline, all_scores, torch.ones_like(all_scores)),
            "losses/grad_norm": dist.local(grad_norms["policy"]),
        }
        if args.eval_every and step % args.eval_every == 0:  # held out: greedy, or with --reward-model the gold
            scalars.update(gold.evaluate(policy, ref_model, scorer, tokenizer, task, args, eos_ids, device, dtype))
        losses = common.logged_losses(updates)
        bookkeeping.log_step(writer, step, scalars, losses, timer, history["tokens"], device)
        scheduler.step()  # after logging the rate this step's updates used
        common.print_samples(step, sampled, args.group_size, args.sample_every)
        if stop.requested() or (args.save_every and step % args.save_every == 0):
            carried = dict(history=history, setup=setup)  # what the next step starts from
            checkpoints.save_checkpoint(
                checkpoint_dir, SCRIPT, args, trained, tokenizer, step, optimizer, scheduler, sampler, **carried
            )
        if stop.name:
            stop.exit(step, writer, SCRIPT)

    final_dir = lora.save_final(policy, tokenizer, run_dir, args)  # final/, and final-merged/ with --lora-merged
    writer.close()
    bookkeeping.print_summary(SCRIPT, history, time.time() - run.start_time, device, final_dir, args.reward_model)
    return history["score"]


if __name__ == "__main__":
    bookkeeping.run_main(lambda: main(*flags.parse_args(Args, HUB_DEFAULTS)))
