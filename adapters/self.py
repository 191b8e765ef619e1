"""This project as a verify.py adapter: the reference every other adapter is compared with.

`python verify.py DUMP --against self` recomputes a dump with the functions grpo.py and ppo.py call, so it
must pass on any fresh dump (the self-check). verify.py also uses this file for what only this project can
say: the initial models, the gradient of this project's loss, and the optimizer that replays GRPO's updates.
It is also the example to copy when writing an adapter for your own code (see verify.py's docstring).
"""

import torch

import common
import grpo
import ppo


def group_advantages(batch, args):
    return grpo.group_advantages(batch["rewards"], args["group_size"], args["scale_rewards"])


def gae(batch, args):
    mask = batch["completion_mask"]
    advantages, returns = ppo.compute_gae(batch["rewards"], batch["values"], mask, args["gamma"], args["lam"])
    return common.masked_whiten(advantages, mask), returns


def token_logprobs(model, batch, args):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    return common.token_logprobs(model, input_ids, attention_mask, batch["completion_mask"], args["temperature"])


def _grpo_logratio(new_logp, batch, args):
    logratio = new_logp - (batch["old_logp"] if args["num_iterations"] > 1 else new_logp.detach())
    if args["importance_level"] == "sequence":  # GSPO: one ratio per completion
        logratio = common.masked_mean(logratio, batch["completion_mask"], dim=1)[:, None].expand_as(logratio)
    return logratio


def _grpo_kl(new_logp, logratio, batch, args):
    kl = common.kl_estimate(new_logp, batch["ref_logp"], "k3")
    return kl * torch.exp(logratio) if args.get("bias_corrected_kl") else kl


def _per_token_loss(new_logp, batch, args, new_values=None):
    """GRPO: clipped surrogate + beta * k3; PPO: clipped surrogate + vf_coef * clipped value loss."""
    if args["script"] == "ppo":
        pg_loss = common.clipped_policy_loss(new_logp - batch["old_logp"], batch["advantages"], args["clip_low"], args["clip_high"])
        v_loss = ppo.clipped_value_loss(new_values, batch["values"], batch["returns"], args["cliprange_value"])
        return pg_loss + args["vf_coef"] * v_loss
    logratio = _grpo_logratio(new_logp, batch, args)
    loss = common.clipped_policy_loss(logratio, batch["advantages"][:, None], args["clip_low"], args["clip_high"])
    if args["beta"] > 0:
        loss = loss + args["beta"] * _grpo_kl(new_logp, logratio, batch, args)
    return loss


def _aggregate(per_token_loss, batch, args):
    agg = "token-mean" if args["script"] == "ppo" else args["loss_agg"]
    return common.aggregate_loss(
        per_token_loss, batch["completion_mask"], agg, batch["num_seqs"], batch["num_tokens"], args["max_new_tokens"]
    )


def kl(batch, args):
    if args["script"] == "ppo":
        return common.kl_estimate(batch["old_logp"], batch["ref_logp"], args["kl_estimator"])
    return _grpo_kl(batch["new_logp"], _grpo_logratio(batch["new_logp"], batch, args), batch, args)


def per_token_loss(batch, args):
    return _per_token_loss(batch["new_logp"], batch, args, batch.get("new_values"))


def loss(batch, args):
    return _aggregate(per_token_loss(batch, args), batch, args)


def train_loss(model, batch, args, critic=None):
    new_logp = token_logprobs(model, batch, args)
    new_values = None
    if critic is not None:
        new_values = ppo.token_values(
            critic, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_mask"],
        )  # fmt: skip
    return _aggregate(_per_token_loss(new_logp, batch, args, new_values), batch, args)


def update(model, batch, args):
    """One step of grpo.py's optimizer from fresh state: AdamW after clipping the gradient's norm."""
    opt, _ = optimizer(model, args)
    model.train()
    train_loss(model, batch, args).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args["max_grad_norm"])
    opt.step()


# What only this project can provide to verify.py.


def initial_models(args):
    """The models step 1 started from: the policy (also the reference) and, for PPO, the critic."""
    device = torch.device("cpu")
    policy = common.load_causal_lm(args["model"], device)
    critic = ppo.load_critic(args["critic_model"] or args["model"], device) if args["script"] == "ppo" else None
    return policy, critic


def optimizer(model, args):
    """AdamW and the warmup schedule exactly as grpo.py builds them, to replay its updates."""
    opt = torch.optim.AdamW(model.parameters(), lr=args["learning_rate"], weight_decay=args["weight_decay"])
    warmup = args["warmup_steps"]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup + 1)))
