"""PPO with a learned critic for language models (RLHF-style), in one file.

Schulman et al. 2017 (PPO), as used for language models by Ziegler et al. 2019 and Ouyang et al.
2022 (InstructGPT). A value model (its own copy of the LM with a scalar head) estimates the return
of every prefix; the per-token reward is the task's score at the last real token (a dense reward: each
value on the token that earned it) minus a per-token KL penalty to a frozen reference; advantages come
from GAE over the critic's values; the loss is the PPO-clip surrogate plus a clipped value loss, for
several epochs over minibatches.

    python ppo.py                                                    # tiny model, copy task, CPU, ~3 min
    python ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --task gsm8k    # a hub model gets HUB_DEFAULTS
    python ppo.py --model Qwen/Qwen2.5-7B-Instruct --task gsm8k --lora-rank 16 --learning-rate 1e-5    # LoRA, one GPU
    python ppo.py --target-kl 0.1                                    # adaptive KL coefficient

Where this departs from the papers:
  1. The score is added at the last real token (the EOS, or the last token when there is none),
     never at a padding position; --missing-eos-penalty lowers the score of truncated completions.
  2. Advantages are whitened over real tokens only; returns use the unwhitened advantages.
  3. The log-probs use logits divided by the sampling temperature, the distribution that sampled.
  4. Weights stay float32 under bf16 autocast on GPU, so small learning rates are not rounded away.
  5. The default run's KL penalty is an entropy bonus towards the random tiny model's near-uniform reference,
     and its missing-EOS penalty (0.3; none in HUB_DEFAULTS) teaches it to stop: without them it stays near 0.4.
  6. Rewards are not whitened by default (lm-human-preferences scales them to unit variance; --whiten-rewards
     does): the critic learns returns in the task's own units, which --cliprange-value is measured in.
"""

import functools
import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

import common
from machinery import batches, bookkeeping, checkpoints, dumps, flags, gold, lora, models, precision, scoring, startup
from machinery import distributed as dist  # torchrun support (machinery/distributed.py): identities on one process
from machinery.critic import load_critic  # PPO's value model: the policy's transformer, a scalar head
from machinery.flag_checks import check_ppo_args
from machinery.tiny_model import TINY_MODEL
from tasks import load_task


@dataclass
class Args(flags.RunArgs):
    """PPO with a critic (see the top of ppo.py); the first flags (data, precision, checkpoints, logs) are shared
    with grpo.py. The defaults are the built-in tiny model's; on any other model, HUB_DEFAULTS replace some."""

    # Shared with the other algorithm file: the same names, meanings and (but for the sizes) defaults.
    exp_name: str = "ppo"
    """name of this experiment, part of the run folder's name"""
    seed: int = 1
    """seed of Python, numpy, torch and the prompt order"""
    model: str = TINY_MODEL
    """hub id, local folder or .gguf file of a causal LM; `tiny` is the built-in ~1M-parameter model"""
    task: str = "copy"
    """task to train on (see tasks/__init__.py)"""
    preset: Optional[Literal["tiny", "hub"]] = None
    """`hub` applies HUB_DEFAULTS to the fields left at their default (by default: on any model but tiny)"""
    num_steps: int = 350
    """training steps; each samples prompts_per_step * samples_per_prompt completions"""
    prompts_per_step: int = 64
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
    # PPO's own: the critic, the KL penalty in the reward, GAE and the value loss.
    critic_model: Optional[str] = None
    """hub id or local folder the critic's backbone starts from (default: the policy's weights)"""
    samples_per_prompt: int = 1
    """completions per prompt (PPO needs no group: the critic provides the baseline)"""
    critic_learning_rate: float = 5e-4
    """AdamW learning rate of the critic"""
    update_epochs: int = 2
    """passes over each batch"""
    num_minibatches: int = 2
    """optimizer steps per epoch; must divide the batch"""
    kl_coef: float = 0.02
    """coefficient of the per-token KL penalty in the reward; 0 (and no target_kl) loads no reference"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """estimator of the per-token KL penalty (Schulman's k1, k2, k3)"""
    target_kl: Optional[float] = None
    """when set, adapt kl_coef so each completion's summed KL (k1, whatever kl_estimator) tracks this value"""
    kl_horizon: int = 10000
    """horizon of the adaptive KL controller, in completions"""
    missing_eos_penalty: float = 0.3
    """subtracted from the score of completions that never emitted EOS"""
    gamma: float = 1.0
    """discount factor of GAE"""
    lam: float = 0.95
    """lambda of GAE"""
    adv_eps: float = 1e-8
    """added to the advantages' variance when whitening them: a peer's value makes a dump it matches exactly"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    ent_coef: float = 0.0
    """weight of the entropy bonus in the loss (Schulman et al. 2017, eq. 9); 0: none, the entropy only logged"""
    cliprange_value: float = 0.2
    """the new value is kept within this distance of the rollout value in the clipped value loss"""
    whiten_rewards: bool = False
    """scale the per-token rewards to unit variance over real tokens before GAE (TRL's whiten_rewards); the
    critic's values and targets, and so --cliprange-value, are then in those units"""


# On a model other than tiny, these replace the defaults above (a real model must never get the tiny model's
# learning rate); a flag given on the command line wins. Printed at start.
HUB_DEFAULTS = dict(num_steps=500, max_new_tokens=512, learning_rate=1e-6, micro_batch_size=8)  # sizes and rate
HUB_DEFAULTS.update(
    critic_learning_rate=1e-5, update_epochs=4, num_minibatches=4, kl_coef=0.05, missing_eos_penalty=0.0
)
# A dump keeps these of the last update's first micro-batch (the models have moved), and every minibatch's rows.
SCRIPT = "ppo"  # names its checkpoints, dumps and logs
DUMPED = ("micro_index", "minibatch_index", "new_logp", "new_values", "entropy", "per_token_loss")


check_args = functools.partial(check_ppo_args, hub_defaults=HUB_DEFAULTS)  # machinery/flag_checks.py
LOADERS = {"policy": models.load_causal_lm, "critic": load_critic}  # what --resume builds each checkpoint into


def rollout_values(critic, inputs, args):
    """The critic's values [N, T] of a sampled batch (token_values), by micro-batches, as the rollout's log-probs."""
    return batches.in_micro_batches(token_values, critic, inputs, args.micro_batch_size)


def token_values(critic, input_ids, attention_mask, completion_mask):
    """V(s_t) for every completion token: the value of the prefix that generates it, [B, T]. Without a critic
    (--vf-coef 0) every value is 0: what the zero-initialised head gives when nothing ever trains it."""
    if critic is None:
        return torch.zeros(completion_mask.shape, device=completion_mask.device)
    T = completion_mask.shape[1]
    return critic(input_ids, attention_mask)[:, -T - 1 : -1] * completion_mask  # the state before token t, as logp's


def kl_estimate(logp, ref_logp, kind):
    """Per-token estimate of KL(policy || ref) from the log-probs of tokens sampled from the policy.

    With log r = ref_logp - logp (Schulman 2020, "Approximating KL Divergence"):
      k1 = -log r                 unbiased, can be negative per token
      k2 = (log r)^2 / 2          biased, always >= 0
      k3 = (r - 1) - log r        unbiased, always >= 0 (the one GRPO puts in its loss)
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3', not {kind!r}")


def compute_rewards(batch, args, mean=common.masked_mean):
    """The per-token reward [N, T] and the KL it penalises [N, T], from a batch of the dump's names (token_scores: the
    task's reward on the tokens that earned it). The entry point the loop and verify.py's self-check call."""
    mask = batch["completion_mask"]
    has_eos = (torch.isin(batch["completion_ids"], batch["eos_ids"]) & mask.bool()).any(1)  # [N]
    penalty = scoring.score_at_last_token(args.missing_eos_penalty * (~has_eos).float(), mask)  # [N, T]
    kl = kl_estimate(batch["old_logp"], batch["ref_logp"], args.kl_estimator) * mask  # [N, T]
    rewards = -batch["kl_coef"] * kl + (batch["token_scores"] - penalty)
    if args.whiten_rewards:  # scale only, the mean is kept (departure 6)
        rewards = common.masked_whiten(rewards, mask, shift_mean=False, mean=mean)
    return rewards, kl


def adaptive_kl_coef(kl_coef, kl, target_kl, n_completions, horizon):
    """Ziegler et al. 2019's proportional controller: move kl_coef so the observed KL tracks the target.
    `kl`: the mean over completions of the summed k1, unbiased whatever the penalty's --kl-estimator.

      error = clip(kl / target - 1, -0.2, 0.2);  kl_coef <- kl_coef * (1 + error * n_completions / horizon)
    """
    error = min(max(kl / target_kl - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_completions / horizon)


def next_kl_coef(batch, args, gather=lambda x: x):
    """The KL coefficient of the next step: with --target-kl, adaptive_kl_coef fed the mean summed k1 KL of this
    step's completions (`gather`: under torchrun, every process's), whatever the penalty's --kl-estimator."""
    if args.target_kl is None:
        return float(batch["kl_coef"])
    seq_kl = gather((kl_estimate(batch["old_logp"], batch["ref_logp"], "k1") * batch["completion_mask"]).sum(1))
    return adaptive_kl_coef(float(batch["kl_coef"]), seq_kl.mean().item(), args.target_kl, len(seq_kl), args.kl_horizon)


def setup_state(sample, models, args):
    """State measured once, before the first step and after the models load (docs/fork.md): e.g. a reward's gain and
    bias on the initial policy's completions (`sample()`: one round, scored; `models`: by name). A dict of tensors and
    numbers: the checkpoint carries it (a resumed run gets it back, never measured again) and every step's batch holds
    it under its own names, so each entry point, the dumps and verify.py read it. PPO measures nothing."""
    return {}


def compute_gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), per token. Returns (advantages, returns).

      delta_t = r_t + gamma * V_{t+1} - V_t
      A_t     = delta_t + gamma * lam * A_{t+1}
      R_t     = A_t + V_t                       (the critic's regression target)

    rewards, values, mask: [B, T]. A masked position counts as beyond the end of the episode:
    its value is 0 and nothing bootstraps from it. Masked positions come back as 0.
    """
    T = rewards.shape[1]
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    last_gae = torch.zeros_like(values[:, 0])
    for t in reversed(range(T)):
        next_real = mask[:, t + 1] if t + 1 < T else torch.zeros_like(last_gae)
        next_value = values[:, t + 1] * next_real if t + 1 < T else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * next_real * last_gae
        advantages[:, t] = last_gae
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def compute_advantages(batch, args, mean=common.masked_mean):
    """(advantages, returns) [N, T]: GAE over the batch's values and rewards, the advantages whitened over real
    tokens (`mean`: under torchrun, every process's). The entry point the loop and verify.py's self-check call."""
    mask = batch["completion_mask"]
    advantages, returns = compute_gae(batch["rewards"], batch["values"], mask, args.gamma, args.lam)
    return common.masked_whiten(advantages, mask, eps=args.adv_eps, mean=mean), returns


def clipped_policy_loss(logratio, advantages, clip_low, clip_high):
    """Per-token PPO-clip surrogate loss (Schulman et al. 2017, eq. 7), a loss to minimise:

      ratio_t = exp(logp_t - old_logp_t)
      loss_t  = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))

    A_t is the token's own advantage [n, T], from GAE over the critic's values: the credit differs per token.
    """
    ratio = torch.exp(logratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.max(pg_loss1, pg_loss2)


def clipped_value_loss(values, old_values, returns, cliprange_value):
    """Per-token clipped value loss (the PPO2 baselines / Ziegler et al. 2019 form):

    V_clip = V_old + clip(V - V_old, -c, c)
    loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)
    """
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    return 0.5 * torch.max((values - returns) ** 2, (values_clipped - returns) ** 2)


def ppo_loss(new_logp, old_logp, advantages, new_values, old_values, returns, mask, minibatch_tokens, args, entropy):
    """PPO's loss on one micro-batch (Schulman et al. 2017, eq. 9), as its share of its minibatch's loss:

      L_t  = max(-A_t ratio_t, -A_t clip(ratio_t, 1 - clip_low, 1 + clip_high)) + vf_coef * value_loss_t
             - ent_coef * H_t                   H_t: the policy's entropy at token t
      loss = sum of L_t over real tokens / the minibatch's real tokens (each token of the minibatch weighs the same)

    new_logp, new_values and entropy [n, T] carry the gradients (the entropy only when ent_coef > 0);
    old_logp, advantages, old_values, returns [n, T] do not.
    Returns the loss and, detached, every per-token tensor of the micro-batch (for dumps and logs), with the tokens
    whose gradient a clip cut off (`clipped`, `value_clipped`: losses/clipfrac and verify's notes read them).
    """
    logratio = new_logp - old_logp  # [n, T]
    pg_loss = clipped_policy_loss(logratio, advantages, args.clip_low, args.clip_high)  # [n, T]
    v_loss = clipped_value_loss(new_values, old_values, returns, args.cliprange_value)  # [n, T]
    per_token_loss = (pg_loss + args.vf_coef * v_loss - args.ent_coef * entropy) * mask  # [n, T], 0 on padding
    loss = per_token_loss.sum() / max(minibatch_tokens, 1)
    terms = dict(
        new_logp=new_logp,
        new_values=new_values,
        old_values=old_values,
        advantages=advantages,
        mask=mask,
        logratio=logratio,
        pg_loss=pg_loss,
        v_loss=v_loss,
        clipped=common.clipped_tokens(logratio, advantages, args.clip_low, args.clip_high),  # losses/clipfrac's
        value_clipped=(new_values - old_values).abs() > args.cliprange_value,  # losses/clipfrac_value's
        entropy=entropy,
        per_token_loss=per_token_loss,
        loss=loss,
    )
    return loss, {key: value.detach() for key, value in terms.items()}


def compute_loss(outputs, batch, args):
    """ppo_loss from the models' outputs (new_logp, new_values, entropy) on a micro-batch of the dump's names
    (num_tokens: its minibatch's real tokens). The entry point the loop and verify.py's self-check call: a new term
    goes here."""
    new_logp, new_values, entropy = outputs["new_logp"], outputs["new_values"], outputs["entropy"]
    old_logp, advantages, values, returns = batch["old_logp"], batch["advantages"], batch["values"], batch["returns"]
    mask, tokens = batch["completion_mask"], batch["num_tokens"]
    return ppo_loss(new_logp, old_logp, advantages, new_values, values, returns, mask, tokens, args, entropy)


def main(args, flags_given=()):
    # SETUP: every flag, model name, the task, the checkpoint and the memory bound checked before anything loads.
    run = startup.start(SCRIPT, args, HUB_DEFAULTS, flags_given, check_args, load_task)
    task, device, dtype, run_dir = run.task, run.device, run.dtype, run.run_dir
    tokenizer, policy = startup.load_policy(args, device)  # float32 master weights; --lora-rank: adapters
    # The critic is a separate network: sharing the policy's backbone would let value gradients move the policy.
    # With --vf-coef 0 none is loaded and every value is 0 (token_values), as a critic never trained would give.
    critic = load_critic(args.critic_model or args.model, device, args) if args.vf_coef > 0 else None
    trained = {name: model for name, model in (("policy", policy), ("critic", critic)) if model is not None}
    if critic is not None and precision.activation_checkpointing(policy):  # as the policy's (startup.load_policy)
        precision.set_activation_checkpointing(critic.backbone, True)
    # The reference only enters through the KL penalty (none: not loaded). Held like the policy (float32, the same
    # autocast), so the step-1 KL is 0; with LoRA it is the policy with its adapters off, no second copy.
    ref_model = lora.reference(policy, args, device) if args.kl_coef > 0 or args.target_kl is not None else None
    scorer, eos_ids = startup.load_scorer(args, run, tokenizer, policy)
    sampler = batches.PromptSampler(task.train, args.seed)
    # DISTRIBUTED (torchrun): each process holds a shard of each model; the rest reads as on one.
    policy, critic, ref_model = dist.shard(policy, critic, ref_model)  # in place: `trained` holds them
    sample = functools.partial(  # ROLLOUT's one round: this process's prompts and their completions
        common.sample_round, sampler, policy, tokenizer, scorer, args.samples_per_prompt, args, device, dtype, eos_ids
    )
    lrs = {"policy": args.learning_rate, "critic": args.critic_learning_rate}
    optimizer, scheduler = startup.make_optimizer(trained, lrs, args, common.adamw_param_groups)
    first_step, history = startup.resume(args, run, trained, optimizer, scheduler, sampler, LOADERS)
    kl_coef = run.state["kl_coef"] if args.resume else args.kl_coef
    setup = run.state.get("setup", {}) if args.resume else setup_state(sample, dict(trained, reference=ref_model), args)
    writer = bookkeeping.make_writer(run_dir, args, first_step, **trained, reference=ref_model)
    checkpoint_dir = os.path.join(run_dir, "checkpoint")
    stop = checkpoints.StopSignal(checkpoint_dir)
    timer = bookkeeping.Timer()

    pbar = bookkeeping.progress(SCRIPT, first_step, args.num_steps)
    for step in pbar:
        # ROLLOUT: samples_per_prompt completions for each prompt (under torchrun: this process's prompts).
        with timer("rollout"):
            sampled = sample()
            scores, b_mask = sampled["scores"], sampled["completion_mask"]  # [N], [N, T]
            inputs = batches.model_inputs(sampled)  # input_ids, attention_mask [N, P + T], completion_mask [N, T]
            N = len(scores)
            with torch.no_grad(), common.autocast(device, dtype):  # computed once, before any update
                b_old_logp, b_values = (
                    common.rollout_logprobs(policy, inputs, args),
                    rollout_values(critic, inputs, args),
                )
                b_ref_logp = (
                    common.rollout_logprobs(ref_model, inputs, args) if ref_model else b_old_logp
                )  # [N, T] each

            # ALGO LOGIC: per-token reward = the task's reward where it was earned (an outcome score: the last token,
            # less the missing-EOS penalty) - kl_coef * KL on every token; GAE advantages over the critic's values.
            b_rollout = dict(batches.batch_inputs(sampled, setup), scores=scores, token_scores=sampled["token_scores"])
            b_rollout.update(values=b_values, old_logp=b_old_logp, ref_logp=b_ref_logp, kl_coef=torch.tensor(kl_coef))
            b_rollout["eos_ids"] = torch.tensor(eos_ids, device=device)
            # Each entry point gets its batch from common.entry_batch, as verify.py gives it.
            tensors = common.entry_batch("compute_rewards", b_rollout)
            b_rewards, kl = compute_rewards(tensors, args, mean=dist.masked_mean)
            tensors = common.entry_batch("compute_advantages", dict(b_rollout, rewards=b_rewards))
            b_advantages, b_returns = compute_advantages(tensors, args, mean=dist.masked_mean)  # [N, T] each
            b_rollout.update(rewards=b_rewards, advantages=b_advantages, returns=b_returns)

        # OPTIMIZE: update_epochs passes over the batch in a fresh order, num_minibatches optimizer steps per pass.
        with timer("train"):
            for model in trained.values():
                model.train()
            minibatches = batches.shuffled_minibatches(N, args.update_epochs, args.num_minibatches, device)
            updates = []  # per optimizer step, each micro-batch's terms: checked, dumped and logged below
            for mb_inds in minibatches:
                mb_tokens = dist.sum(int(b_mask[mb_inds].sum()))  # the minibatch's, under torchrun every process's
                mb_batch = dict(b_rollout, num_seqs=len(mb_inds), num_tokens=mb_tokens)
                optimizer.zero_grad(set_to_none=True)
                updates.append([])
                for micro in mb_inds.split(args.micro_batch_size):
                    # The micro-batch's input_ids, attention_mask [n, P + T] and completion_mask [n, T].
                    mb_inputs = [x[micro] for x in inputs]
                    with common.autocast(device, dtype):
                        new_logp, entropy = common.token_logprobs(
                            policy, *mb_inputs, args.temperature, return_entropy=True, entropy_grad=args.ent_coef > 0
                        )  # [n, T]; the entropy is a constant (logged) unless it is in the loss
                        new_values = token_values(critic, *mb_inputs)  # [n, T]
                    outputs = dict(new_logp=new_logp, new_values=new_values, entropy=entropy)
                    micro_batch = common.entry_batch("compute_loss", common.select_rows(mb_batch, micro))
                    loss, terms = compute_loss(outputs, micro_batch, args)
                    loss.backward()
                    updates[-1].append(dict(terms, micro_index=micro, minibatch_index=mb_inds))
                grad_norms = common.clip_grad_norms(trained, args.max_grad_norm)  # each model's own
                dump = dumps.batch_dump(
                    b_rollout, updates[-1][:1], DUMPED, minibatches=[u[0]["minibatch_index"] for u in updates]
                )
                dumps.stop_if_not_finite(step, run_dir, dump, b_rewards, updates[-1], sum(grad_norms.values()))
                optimizer.step()
        dumps.dump_step(args.dump_dir, step, dump)  # with --dump-dir

        # LOGGING: the same names in grpo.py and ppo.py. Under torchrun, over every process's completions and tokens.
        all_scores, seq_rewards = dist.gather(scores, b_rewards.sum(1))
        lengths = bookkeeping.record(history, sampled, all_scores, pbar)  # the score: before the reward's penalties
        scalars = {
            "charts/reward": seq_rewards.mean(),
            "charts/score": history["score"][-1],  # reward: score - penalties
            "charts/reward_std": seq_rewards.std(),
            "charts/completion_length": lengths.mean(),
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            "charts/kl_coef": kl_coef,
            "losses/explained_variance": common.explained_variance(b_values, b_returns, b_mask, dist.masked_mean),
            "losses/grad_norm": dist.local(grad_norms["policy"]),
        }
        if ref_model is not None:
            scalars["losses/kl_ref"] = dist.masked_mean(kl, b_mask)
        if args.eval_every and step % args.eval_every == 0:  # held out: greedy, or with --reward-model the gold
            scalars.update(gold.evaluate(policy, ref_model, scorer, tokenizer, task, args, eos_ids, device, dtype))
        losses = common.logged_losses(updates)
        bookkeeping.log_step(writer, step, scalars, losses, timer, history["tokens"], device)
        scheduler.step()  # after logging the rate this step's updates used
        common.print_samples(step, sampled, args.samples_per_prompt, args.sample_every)
        kl_coef = next_kl_coef(b_rollout, args, gather=dist.gather)  # with --target-kl: adapted to this step's KL
        if stop.requested() or (args.save_every and step % args.save_every == 0):
            carried = dict(history=history, kl_coef=kl_coef, setup=setup)  # what the next step starts from
            checkpoints.save_checkpoint(
                checkpoint_dir, SCRIPT, args, trained, tokenizer, step, optimizer, scheduler, sampler, **carried
            )
        if stop.name:
            stop.exit(step, writer, SCRIPT)

    final_dir = lora.save_final(policy, tokenizer, run_dir, args)  # final/, and final-merged/ with --lora-merged
    if critic is not None:
        checkpoints.save_model(critic, tokenizer, os.path.join(run_dir, "critic"), step=args.num_steps)
    writer.close()
    bookkeeping.print_summary(SCRIPT, history, time.time() - run.start_time, device, final_dir, args.reward_model)
    return history["score"]


if __name__ == "__main__":
    bookkeeping.run_main(lambda: main(*flags.parse_args(Args, HUB_DEFAULTS)))
