"""This project as a verify.py adapter: the reference every other adapter is compared with.

`python verify.py DUMP --against self` recomputes a dump with the functions grpo.py and ppo.py call, so it
must pass on any fresh dump (the self-check). verify.py also uses this file for what only this project can
say: the initial models, the gradient of this project's loss, and the optimizer that replays GRPO's updates.
It is also the example to copy when writing an adapter for your own code (see verify.py's docstring).
"""

import types

import torch

import common
import grpo
import lora
import models
import ppo


def group_advantages(batch, args):
    return grpo.group_advantages(batch["rewards"], args["group_size"], args["scale_rewards"])


def gae(batch, args):
    mask = batch["completion_mask"]
    advantages, returns = ppo.compute_gae(batch["rewards"], batch["values"], mask, args["gamma"], args["lam"])
    return ppo.masked_whiten(advantages, mask), returns


def token_logprobs(model, batch, args):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    mask = batch["completion_mask"]
    return common.token_logprobs(model, input_ids, attention_mask, mask, args["temperature"])


def _loss(new_logp, batch, args, new_values=None):
    """grpo.grpo_loss or ppo.ppo_loss, the functions the training loops call: (loss, per-token terms)."""
    mask, flags = batch["completion_mask"], types.SimpleNamespace(**args)
    if args["script"] == "ppo":
        return ppo.ppo_loss(new_logp, batch["old_logp"], batch["advantages"], new_values, batch["values"],
                            batch["returns"], mask, batch["num_tokens"], flags)  # fmt: skip
    old_logp = batch["old_logp"] if args["num_iterations"] > 1 else new_logp.detach()  # mu = 1: ratio 1
    ref_logp = batch["ref_logp"] if args["beta"] > 0 else None
    return grpo.grpo_loss(new_logp, old_logp, ref_logp, batch["advantages"], mask, batch["num_seqs"],
                          batch["num_tokens"], flags)  # fmt: skip


def kl(batch, args):
    if args["script"] == "ppo":
        return ppo.kl_estimate(batch["old_logp"], batch["ref_logp"], args["kl_estimator"])
    return _loss(batch["new_logp"], batch, args)[1]["kl_ref"]


def per_token_loss(batch, args):
    return _loss(batch["new_logp"], batch, args, batch.get("new_values"))[1]["per_token_loss"]


def loss(batch, args):
    return _loss(batch["new_logp"], batch, args, batch.get("new_values"))[0]


def train_loss(model, batch, args, critic=None):
    new_logp = token_logprobs(model, batch, args)
    new_values = None
    if critic is not None:
        new_values = ppo.token_values(
            critic, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_mask"],
        )  # fmt: skip
    return _loss(new_logp, batch, args, new_values)[0]


def update(model, batch, args):
    """One step of grpo.py's optimizer from fresh state: AdamW after clipping the gradient's norm."""
    opt, _ = optimizer(model, args)
    model.train()
    train_loss(model, batch, args).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args["max_grad_norm"])
    opt.step()


# What only this project can provide to verify.py.


def initial_models(args):
    """The models step 1 started from: the policy (also the reference) and, for PPO, the critic; with LoRA, with
    the run's initial adapters (lora.wrap draws them from --seed), whose B = 0 leaves the reference the base."""
    device = torch.device("cpu")
    policy = lora.wrap(models.load_causal_lm(args["model"], device), args)
    if args["script"] == "grpo":
        return policy, None
    critic = ppo.load_critic(args["critic_model"] or args["model"], device)
    lora.wrap(critic.backbone, args, task_type=None)
    return policy, critic


def optimizer(model, args):
    """AdamW and the warmup schedule exactly as grpo.py builds them, to replay its updates."""
    groups = common.adamw_param_groups(model, args["weight_decay"], args.get("decay_norms_and_biases", True))
    opt = torch.optim.AdamW(groups, lr=args["learning_rate"])
    warmup = args["warmup_steps"]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup + 1)))
