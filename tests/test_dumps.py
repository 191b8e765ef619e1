"""--dump-dir: every derived number in a step's dump can be recomputed from the dump's own inputs,
its metadata.json and the reference formulas, as someone checking another implementation would."""

import argparse
import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import common
import grpo
import ppo
from machinery import generation, models, scoring
from machinery.tiny_model import TINY_MODEL
from tasks import load_task

ATOL = 1e-6


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def read_dump(dump_dir, step):
    with open(os.path.join(dump_dir, "metadata.json")) as f:
        meta = json.load(f)
    return meta, load_file(os.path.join(dump_dir, f"step{step:06d}.safetensors"))


def full_ids(d):
    return torch.cat([d["prompt_ids"], d["completion_ids"]], 1), torch.cat([d["prompt_mask"], d["completion_mask"]], 1)


def check_scores(d, scores):
    """The copy task's score of each stored completion, from the decoded ids: "123=" -> "123" scores 1."""
    tokenizer = models.load_tokenizer(TINY_MODEL)
    prompts = tokenizer.batch_decode(d["prompt_ids"], skip_special_tokens=True)
    completions = generation.decode_completions(
        tokenizer, d["completion_ids"], d["completion_mask"], [tokenizer.eos_token_id]
    )
    expected = load_task("copy").score(prompts, completions, [p.removesuffix("=") for p in prompts])
    assert scores.tolist() == pytest.approx(expected, abs=ATOL)


def logprobs_of(model_path, d, temperature, rows=slice(None)):
    model = models.load_causal_lm(model_path, torch.device("cpu"))
    input_ids, attention_mask = full_ids(d)
    with torch.no_grad():
        return common.token_logprobs(
            model, input_ids[rows], attention_mask[rows], d["completion_mask"][rows], temperature
        )


GRPO_VARIANTS = {
    "defaults": dict(),
    "iterations-kl-token-mean": dict(num_iterations=2, beta=0.1, loss_agg="token-mean", clip_low=0.1, clip_high=0.05),
    "gspo-sum-norm-micro": dict(
        importance_level="sequence",
        loss_agg="seq-mean-token-sum-norm",
        scale_rewards="group",
        micro_batch_size=4,
        num_iterations=2,
        beta=0.0,
        learning_rate=1e-2,
    ),
    "dr-grpo": dict(scale_rewards="none", loss_agg="seq-mean-token-sum-norm", beta=0.0),
}


@pytest.mark.exact
@pytest.mark.parametrize("variant", GRPO_VARIANTS)
def test_grpo_dump_recomputes(variant, tmp_path):
    dump_dir = str(tmp_path / "dump")
    fields = dict(seed=3, num_steps=2, prompts_per_step=3, group_size=4, max_new_tokens=4, sample_every=0)
    grpo.main(grpo.Args(**fields, **GRPO_VARIANTS[variant], output_dir=str(tmp_path / "runs"), dump_dir=dump_dir))
    assert sorted(os.listdir(dump_dir)) == ["metadata.json", "step000001.safetensors", "step000002.safetensors"]

    for step in (1, 2):
        meta, d = read_dump(dump_dir, step)
        a = meta["args"]
        assert meta["script"] == "grpo" and {"python", "torch", "transformers"} <= meta["versions"].keys()
        mask, N = d["completion_mask"], len(d["completion_mask"])
        assert N == a["prompts_per_step"] * a["group_size"]
        check_scores(d, d["rewards"])

        advantages = grpo.group_advantages(d["rewards"], a["group_size"], a["scale_rewards"])
        close(d["advantages"], advantages)
        # The dump holds the last of the num_iterations passes: its log-probs, per-token losses and loss.
        logratio = d["new_logp"] - d["old_logp"]
        if a["importance_level"] == "sequence":
            logratio = common.masked_mean(logratio, mask, dim=1)[:, None].expand_as(logratio)
        per_token_loss = grpo.clipped_policy_loss(logratio, advantages[:, None], a["clip_low"], a["clip_high"])
        if a["beta"] > 0:
            kl = ppo.kl_estimate(d["new_logp"], d["ref_logp"], "k3")
            if a["bias_corrected_kl"]:  # the default: weighted by the ratio, 1 only while the policy has not moved
                kl = kl * torch.exp(logratio)
            per_token_loss = per_token_loss + a["beta"] * kl
        else:
            assert "ref_logp" not in d
        close(d["per_token_loss"], per_token_loss * mask)
        loss = grpo.aggregate_loss(per_token_loss, mask, a["loss_agg"], N, int(mask.sum()), a["max_new_tokens"])
        close(d["loss"], loss)
        if a["num_iterations"] == 1:
            assert torch.equal(d["old_logp"], d["new_logp"])  # the ratio is 1: old is the current policy

    # Step 1 sampled from the initial model, which is also the reference.
    meta, d = read_dump(dump_dir, 1)
    initial = logprobs_of(TINY_MODEL, d, meta["args"]["temperature"])
    close(d["old_logp"], initial)
    if meta["args"]["num_iterations"] == 1:
        close(d["new_logp"], initial)
    if meta["args"]["beta"] > 0:
        close(d["ref_logp"], initial)


def test_grpo_dump_of_a_changed_model_is_not_the_initial_one(tmp_path):
    """The log-prob check above can fail: step 2 sampled from an updated model, whose log-probs differ."""
    dump_dir = str(tmp_path / "dump")
    fields = dict(
        seed=3, num_steps=2, prompts_per_step=3, group_size=4, max_new_tokens=4, sample_every=0, learning_rate=1e-2
    )
    grpo.main(grpo.Args(**fields, output_dir=str(tmp_path / "runs"), dump_dir=dump_dir))
    meta, d = read_dump(dump_dir, 2)
    initial = logprobs_of(TINY_MODEL, d, meta["args"]["temperature"])
    assert (d["new_logp"] - initial).abs().max() > 1e-3


PPO_VARIANTS = {
    "defaults": dict(),
    "no-reference": dict(kl_coef=0.0, missing_eos_penalty=0.0),
    "kl-micro": dict(
        kl_coef=0.1,
        kl_estimator="k3",
        target_kl=0.05,
        missing_eos_penalty=0.5,
        micro_batch_size=2,
        gamma=0.9,
        lam=0.8,
        vf_coef=0.5,
        cliprange_value=0.1,
        clip_high=0.28,
    ),
    "whiten-rewards-entropy": dict(whiten_rewards=True, ent_coef=0.05, micro_batch_size=4),
}


def whiten_scale_only(x, mask):
    """lm-human-preferences' whiten(x, shift_mean=False) over the real tokens: (x - mean) / std + mean."""
    real = x[mask.bool()]
    mean, var = real.mean(), real.var(unbiased=False)
    return torch.where(mask.bool(), (x - mean) / torch.sqrt(var + 1e-8) + mean, torch.zeros_like(x))


def entropy_of(model_path, d, temperature, rows):
    """The policy's entropy at each completion token, by a full softmax: -sum_v p_v log p_v."""
    model = models.load_causal_lm(model_path, torch.device("cpu"))
    input_ids, attention_mask = full_ids(d)
    T = d["completion_mask"].shape[1]
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=input_ids[rows], attention_mask=attention_mask[rows], position_ids=position_ids[rows]
        ).logits
    logp = torch.log_softmax(logits[:, -T - 1 : -1].float() / temperature, -1)
    return -(logp.exp() * logp).sum(-1) * d["completion_mask"][rows]


def check_ppo_dump(meta, d, eos_ids):
    a = meta["args"]
    assert meta["script"] == "ppo"
    mask = d["completion_mask"]
    check_scores(d, d["scores"])

    has_eos = (torch.isin(d["completion_ids"], torch.tensor(eos_ids)) & mask.bool()).any(1)
    penalised = d["scores"] - a["missing_eos_penalty"] * (~has_eos).float()
    kl = ppo.kl_estimate(d["old_logp"], d["ref_logp"], a["kl_estimator"]) * mask
    rewards = -d["kl_coef"] * kl + scoring.score_at_last_token(penalised, mask)
    if a.get("whiten_rewards"):
        rewards = whiten_scale_only(rewards, mask)
    close(d["rewards"], rewards)
    advantages, returns = ppo.compute_gae(rewards, d["values"], mask, a["gamma"], a["lam"])
    close(d["returns"], returns)
    advantages = common.masked_whiten(advantages, mask)
    close(d["advantages"], advantages)

    # The first micro-batch (rows micro_index) of the last minibatch (rows minibatch_index) of the last epoch, and
    # every minibatch's rows in the order of the updates (the last one's included).
    idx, minibatch = d["micro_index"], d["minibatch_index"]
    order = d["minibatches"].view(-1, len(minibatch))
    assert len(order) == a["update_epochs"] * a["num_minibatches"] and order[-1].tolist() == minibatch.tolist()
    assert set(idx.tolist()) <= set(minibatch.tolist()) and len(idx) == min(a["micro_batch_size"], len(minibatch))
    mb_mask = mask[idx]
    pg_loss = ppo.clipped_policy_loss(
        d["new_logp"] - d["old_logp"][idx], advantages[idx], a["clip_low"], a["clip_high"]
    )
    v_loss = ppo.clipped_value_loss(d["new_values"], d["values"][idx], returns[idx], a["cliprange_value"])
    per_token_loss = pg_loss + a["vf_coef"] * v_loss - a.get("ent_coef", 0.0) * d["entropy"]
    close(d["per_token_loss"], per_token_loss * mb_mask)
    loss = grpo.aggregate_loss(
        per_token_loss, mb_mask, "token-mean", len(minibatch), int(mask[minibatch].sum()), a["max_new_tokens"]
    )
    close(d["loss"], loss)
    # The reward from its parts: score (less the missing-EOS penalty) at the last real token, the KL penalty.
    close(ppo.compute_rewards(d, argparse.Namespace(**a))[0], rewards)


@pytest.mark.exact
@pytest.mark.parametrize("variant", PPO_VARIANTS)
def test_ppo_dump_recomputes(variant, tmp_path):
    """Step 1, then a resume from its checkpoint to step 2, so the models that made step 2 are on disk."""
    dump_dir = str(tmp_path / "dump")
    fields = dict(
        seed=3,
        prompts_per_step=8,
        max_new_tokens=4,
        sample_every=0,
        output_dir=str(tmp_path / "runs"),
        dump_dir=dump_dir,
    )
    fields.update(PPO_VARIANTS[variant])
    ppo.main(ppo.Args(num_steps=1, save_every=1, **fields))
    (checkpoint,) = glob.glob(str(tmp_path / "runs" / "*" / "checkpoint"))
    ppo.main(ppo.Args(num_steps=2, resume=checkpoint, **fields))  # save_every 0: the step-1 checkpoint stays
    tokenizer = models.load_tokenizer(TINY_MODEL)
    eos_ids = models.eos_token_ids(models.load_causal_lm(TINY_MODEL, torch.device("cpu")), tokenizer)

    for step in (1, 2):
        meta, d = read_dump(dump_dir, step)
        check_ppo_dump(meta, d, eos_ids)
        if meta["args"]["target_kl"] is None:
            assert d["kl_coef"].item() == pytest.approx(meta["args"]["kl_coef"])

    meta, d = read_dump(dump_dir, 1)
    temperature = meta["args"]["temperature"]
    close(d["old_logp"], logprobs_of(TINY_MODEL, d, temperature))  # step 1 sampled from the initial model

    meta, d = read_dump(dump_dir, 2)
    close(d["old_logp"], logprobs_of(os.path.join(checkpoint, "policy"), d, temperature))
    if meta["args"]["kl_coef"] > 0:
        close(d["ref_logp"], logprobs_of(TINY_MODEL, d, temperature))
    else:
        assert torch.equal(d["ref_logp"], d["old_logp"])  # no reference: the penalty is 0
    critic = ppo.load_critic(os.path.join(checkpoint, "critic"), torch.device("cpu"))
    input_ids, attention_mask = full_ids(d)
    with torch.no_grad():
        close(d["values"], ppo.token_values(critic, input_ids, attention_mask, d["completion_mask"]))


def test_ppo_dumped_entropy_is_the_full_softmax_entropy(tmp_path):
    """One update in the step (one epoch, one minibatch): the dumped micro-batch is computed before any update."""
    dump_dir = str(tmp_path / "dump")
    ppo.main(
        ppo.Args(
            seed=3,
            prompts_per_step=8,
            max_new_tokens=4,
            sample_every=0,
            num_steps=1,
            update_epochs=1,
            num_minibatches=1,
            output_dir=str(tmp_path / "runs"),
            dump_dir=dump_dir,
        )
    )
    meta, d = read_dump(dump_dir, 1)
    close(d["entropy"], entropy_of(TINY_MODEL, d, meta["args"]["temperature"], d["micro_index"]))
