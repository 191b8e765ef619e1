"""Where a shipped adapter puts a peer's loss together from the peer's pieces, the peer's own assembly gives the
same loss on the same batch: verl's ppo_loss (verl/workers/utils/losses.py) against the verl adapter. The OpenRLHF
adapter runs OpenRLHF's own training_step; here its loss is checked against OpenRLHF's pieces written as
training_step writes them (the KL a token mean whatever the policy loss's mode), and its difference from this
project's loss is exactly the KL's aggregation (the known difference it declares). TRL's adapter assembles nothing:
its loss is GRPOTrainer._compute_loss, its train_loss GRPOTrainer.compute_loss. SkyRL's and AReaL's adapters run their
workers and engine themselves (verifier/skyrl_site.py, areal_site.py): tests/test_verify_skyrl.py and
test_verify_areal.py plant bugs there."""

import os
import sys

import pytest
import torch
from verify_helpers import GRPO_RECIPE, PPO_RECIPE, make_dump, site

from verifier.calls import load_adapter
from verifier.dump import inputs, load_dump, micro_batch, whole_batch

OPENRLHF_GRPO = dict(GRPO_RECIPE, scale_rewards="group", adv_eps=1e-9, bias_corrected_kl=False)  # its settings


@pytest.fixture(autouse=True)
def peers_unloaded():
    """The peers' modules loaded here are dropped after each test: verify's child processes are forks of this one,
    and a later test's planted copy of a peer ($OPENRLHF_SITE) must be the one they load."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("openrlhf", "verl") or name.startswith("verify_adapter_"):
            del sys.modules[name]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("assembly")
    return {
        "grpo": make_dump(folder, "grpo", **dict(OPENRLHF_GRPO, num_steps=2)),
        "ppo": make_dump(folder, "ppo", **dict(PPO_RECIPE, num_steps=1)),
    }


def loss_batch(dump, step, **changes):
    args, steps, _, _ = load_dump(dump)
    args = dict(args, **changes)
    d = steps[step]
    batch = micro_batch(d) if args["script"] == "ppo" else whole_batch(d, args)
    return inputs("loss", batch, args), args


def k3(batch):
    log_r = batch["ref_logp"] - batch["new_logp"]
    return log_r.exp() - 1 - log_r


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "token-mean"])
def test_openrlhf_grpo_loss_is_its_training_steps_with_the_kl_a_token_mean(dumps, monkeypatch, loss_agg):
    monkeypatch.setenv("OPENRLHF_SITE", site("openrlhf", "requirements/openrlhf.txt"))
    ours, openrlhf = load_adapter("self"), load_adapter("openrlhf")
    batch, args = loss_batch(dumps["grpo"], 2, loss_agg=loss_agg)
    mask, info = batch["completion_mask"], dict(batch_num_tokens=batch["num_tokens"])
    info["global_batch_size"] = batch["num_seqs"]
    policy = openrlhf.loss_module.PolicyLoss(
        args["clip_low"], args["clip_high"], token_level_loss=loss_agg == "token-mean"
    )
    advantages = batch["advantages"][:, None].expand_as(mask)
    written = policy(batch["new_logp"], batch["old_logp"], advantages, action_mask=mask, **info)[0]
    written = written + args["beta"] * openrlhf.loss_module.aggregate_loss(k3(batch), mask, **info)  # token mean
    assert torch.allclose(openrlhf.loss(batch, args), written, rtol=0, atol=1e-7)
    # its only difference from this project's loss: the KL term's aggregation, token mean against --loss-agg
    kl, real = k3(batch) * mask, mask.sum(1).clamp(min=1)
    token_mean, seq_mean = kl.sum() / mask.sum(), (kl.sum(1) / real).mean()
    expected = args["beta"] * (token_mean - (seq_mean if loss_agg == "seq-mean-token-mean" else token_mean))
    difference = openrlhf.loss(batch, args) - ours.loss(batch, args)
    assert torch.allclose(difference, expected, rtol=0, atol=1e-7)
    assert (abs(expected) > 1e-4) == (loss_agg == "seq-mean-token-mean"), expected  # a real difference, or none


def test_openrlhf_ppo_loss_is_its_training_steps(dumps, monkeypatch):
    """Actor: PolicyLoss - entropy_coef * aggregate_loss(entropy); critic: ValueLoss, scaled by --vf-coef."""
    monkeypatch.setenv("OPENRLHF_SITE", site("openrlhf", "requirements/openrlhf.txt"))
    ours, openrlhf = load_adapter("self"), load_adapter("openrlhf")
    batch, args = loss_batch(dumps["ppo"], 1)
    mask, info = batch["completion_mask"], dict(batch_num_tokens=batch["num_tokens"])
    info["global_batch_size"] = batch["num_seqs"]
    loss_module = openrlhf.loss_module
    policy = loss_module.PolicyLoss(args["clip_low"], args["clip_high"])(
        batch["new_logp"], batch["old_logp"], batch["advantages"], action_mask=mask, **info
    )[0]
    entropy = loss_module.aggregate_loss(batch["entropy"], mask, **info)
    value = loss_module.ValueLoss(args["cliprange_value"])(
        batch["new_values"], batch["values"], batch["returns"], action_mask=mask, **info
    )
    written = policy - args["ent_coef"] * entropy + args["vf_coef"] * value
    assert args["ent_coef"] > 0 and torch.allclose(openrlhf.loss(batch, args), written, rtol=0, atol=1e-7)
    assert torch.allclose(openrlhf.loss(batch, args), ours.loss(batch, args), rtol=0, atol=1e-6)


def verl_ppo_loss(batch, args, losses, ActorConfig):
    """verl's own ppo_loss on the batch: its log-probs (and entropy) laid out as its engine gives them, one value a
    token of each sequence, the response's predicted by the token before it."""
    from tensordict import TensorDict

    mask, prompt_mask = batch["completion_mask"], batch["prompt_mask"]

    def flat(values):
        rows = []
        for i in range(len(mask)):
            p, r = int(prompt_mask[i].sum()), int(mask[i].sum())
            row = torch.zeros(p + r)
            row[p - 1 : p + r - 1] = values[i, :r]
            rows.append(row)
        return torch.cat(rows)

    grpo = args["script"] == "grpo"
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=args.get("group_size", 1),
        use_dynamic_bsz=True,
        clip_ratio_low=args["clip_low"],
        clip_ratio_high=args["clip_high"],
        use_kl_loss=grpo and args["beta"] > 0,
        kl_loss_coef=args.get("beta", 0.0),
        kl_loss_type="low_var_kl",
        loss_agg_mode=args["loss_agg"] if grpo else "token-mean",
        entropy_coeff=0.0 if grpo else args["ent_coef"],
    )
    advantages = batch["advantages"][:, None].expand_as(mask) if grpo else batch["advantages"]
    data = dict(
        prompts=batch["prompt_ids"],
        responses=batch["completion_ids"],
        attention_mask=torch.cat([prompt_mask, mask], 1),
        response_mask=mask,
        old_log_probs=batch["old_logp"],
        advantages=advantages,
        dp_size=1,
        batch_num_tokens=batch["num_tokens"],
        global_batch_size=batch["num_seqs"],
    )
    if grpo:
        data["ref_log_prob"] = batch["ref_logp"]
    output = {"log_probs": flat(batch["new_logp"])}
    if not grpo:
        output["entropy"] = flat(batch["entropy"])
    return losses.ppo_loss(config, output, TensorDict(data, batch_size=[]))[0]


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_verl_loss_is_its_ppo_loss(dumps, monkeypatch, script):
    folder = site("verl", "requirements/verl.txt")
    monkeypatch.syspath_prepend(folder)
    if not os.path.isdir(os.path.join(folder, "tensordict")):
        pytest.skip("verl's ppo_loss needs tensordict (requirements/verl.txt)")
    verl = load_adapter("verl")
    from verl.workers.config import ActorConfig
    from verl.workers.utils import losses

    batch, args = loss_batch(dumps[script], 2 if script == "grpo" else 1, vf_coef=0.0)  # verl's critic: its own
    assert torch.allclose(verl.loss(batch, args), verl_ppo_loss(batch, args, losses, ActorConfig), rtol=0, atol=1e-7)
