"""This project as a verify.py adapter: the reference every other adapter is compared with.

`python verify.py DUMP --against self` recomputes a dump with the entry points grpo.py and ppo.py's training loops
call (compute_advantages, compute_rewards, compute_loss), so it passes on any fresh dump, and a change to the
advantage or the loss in the algorithm file flows here with no second edit. verify.py also uses this file for
what only this project can say: the initial models, the gradient of this project's loss, and the optimizer that
replays the updates. It is also the example to copy when writing an adapter (see verify.py's docstring).
"""

import types

import torch

import common
import grpo
import ppo
from machinery import lora, model_checks, models, precision

ALGORITHMS = {"grpo": grpo, "ppo": ppo}


def _algorithm(args):
    """The script's module and its Args as attributes (what its functions read)."""
    return ALGORITHMS[args["script"]], types.SimpleNamespace(**args)


def group_advantages(batch, args):
    algorithm, flags = _algorithm(args)
    return algorithm.compute_advantages(batch, flags)


def gae(batch, args):
    algorithm, flags = _algorithm(args)
    return algorithm.compute_advantages(batch, flags)


def rewards(batch, args):
    algorithm, flags = _algorithm(args)
    return algorithm.compute_rewards(batch, flags)[0]


def kl_coef(batch, args):
    """The coefficient of the next step, from this step's batch, by ppo.py's controller."""
    algorithm, flags = _algorithm(args)
    return torch.tensor(algorithm.next_kl_coef(batch, flags))


def outputs(model, batch, args, critic=None):
    """What the loss reads of the models: the policy's log-probs and entropy, the critic's values (PPO)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    mask = batch["completion_mask"]
    new_logp, entropy = common.token_logprobs(
        model, input_ids, attention_mask, mask, args["temperature"], return_entropy=True, entropy_grad=True
    )
    out = dict(new_logp=new_logp, entropy=entropy)
    if args["script"] == "ppo":  # no critic (--vf-coef 0): values of 0, as in ppo.py
        out["new_values"] = token_values(critic, batch, args)
    return out


def token_values(critic, batch, args):
    """The critic's value of every completion token (PPO), as ppo.py computes them."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    return ppo.token_values(critic, input_ids, attention_mask, batch["completion_mask"])


def token_logprobs(model, batch, args):
    return outputs(model, batch, args)["new_logp"]


def _loss(batch, args):
    """The algorithm's compute_loss on the stored outputs of the models (taken out of the batch: the loop passes
    them apart): (loss, per-token terms)."""
    algorithm, flags = _algorithm(args)
    stored = {key: batch[key] for key in common.MODEL_OUTPUTS if key in batch}
    return algorithm.compute_loss(stored, {k: v for k, v in batch.items() if k not in stored}, flags)


def kl(batch, args):
    if args["script"] == "ppo":
        return rewards_kl(batch, args)
    return _loss(batch, args)[1]["kl_ref"]


def rewards_kl(batch, args):
    return ppo.compute_rewards(batch, types.SimpleNamespace(**args))[1]


def per_token_loss(batch, args):
    return _loss(batch, args)[1]["per_token_loss"]


def loss(batch, args):
    return _loss(batch, args)[0]


def train_loss(model, batch, args, critic=None):
    algorithm, flags = _algorithm(args)
    return algorithm.compute_loss(outputs(model, batch, args, critic), batch, flags)[0]


def update(model, batch, args, state, critic=None, loss=None):
    """One training step of the script's optimizer, as its loop takes it: GRPO num_iterations optimizer steps on the
    whole batch, PPO one a minibatch (batch["minibatches"]: their rows, in the run's order); each accumulated over
    micro-batches with the whole batch's (PPO: minibatch's) denominators, each model's gradient norm clipped, then
    the schedule's step. `state` keeps the optimizer from one call to the next. `loss`: a train_loss to step with
    in place of this project's (verify's known differences: the update a peer makes by design)."""
    if "optimizer" not in state:
        state["optimizer"], state["scheduler"] = optimizer(model, args, critic)
    opt, trained = state["optimizer"], [m for m in (model, critic) if m is not None]
    rows = batch.pop("minibatches", None)
    N = len(batch["completion_mask"])
    rows = [torch.arange(N)] * args["num_iterations"] if rows is None else rows
    for m in trained:
        m.train()
    for minibatch in rows:
        opt.zero_grad(set_to_none=True)
        if args["script"] == "ppo":  # the minibatch's own denominators
            batch = dict(batch, num_seqs=len(minibatch), num_tokens=int(batch["completion_mask"][minibatch].sum()))
        for i in range(0, len(minibatch), args["micro_batch_size"]):
            micro = common.select_rows(batch, minibatch[i : i + args["micro_batch_size"]])
            (loss or train_loss)(model, micro, args, critic).backward()
        for m in trained:
            torch.nn.utils.clip_grad_norm_(m.parameters(), args["max_grad_norm"])
        opt.step()
    state["scheduler"].step()


# What only this project can provide to verify.py.


def initial_models(args):
    """The models step 1 started from: the policy (also the reference) and, for PPO, the critic; with LoRA, with
    the run's initial adapters (lora.wrap draws them from --seed), whose B = 0 leaves the reference the base."""
    device = torch.device("cpu")
    policy = lora.wrap(models.load_causal_lm(args["model"], device), args)
    critic = None
    if args["script"] == "ppo" and args["vf_coef"] > 0:
        critic = ppo.load_critic(args["critic_model"] or args["model"], device, args)
    recomputing(policy, critic, args)
    return policy, critic


def recomputing(policy, critic, args):
    """Activations recomputed in the backward pass where the run recomputed them (--gradient-checkpointing, its
    auto rule on one process): the forward then shares no prompt cache (prompt_cache.shareable_cache), so its
    log-probs and gradients round as the run's did; a replay that shares it drifts by ~3e-5 in two steps."""
    from transformers import AutoConfig

    flags = types.SimpleNamespace(**args)
    critic_config = None
    if critic is not None:
        critic_config = models.from_pretrained(
            AutoConfig, models.resolve_model_path(args["critic_model"] or args["model"])
        )
    on, _ = model_checks.choose_checkpointing(flags, policy.config, 1, critic_config)
    if on:
        precision.set_activation_checkpointing(policy, True)
        if critic is not None:  # as ppo.py does: the critic's backbone as the policy
            precision.set_activation_checkpointing(critic.backbone, True)


def optimizer(model, args, critic=None):
    """AdamW and the warmup schedule exactly as grpo.py (policy) or ppo.py (policy and critic) build them."""
    groups = common.adamw_param_groups(model, args["weight_decay"], args.get("decay_norms_and_biases", True))
    if critic is not None:
        critic_groups = common.adamw_param_groups(critic, args["weight_decay"], args["decay_norms_and_biases"])
        groups = [dict(group, lr=args["learning_rate"]) for group in groups]
        groups += [dict(group, lr=args["critic_learning_rate"]) for group in critic_groups]
    opt = torch.optim.AdamW(groups, lr=args["learning_rate"])
    warmup = args["warmup_steps"]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / (warmup + 1)))
