"""grpo.py and ppo.py, two whole steps each, against a reference written here from the papers' formulas.

The dump tests recompute a step with the trainer's own functions, so a bug shared by the loop and the
recompute cannot show, and their runs have no completion that ends early. Here:
  - the model is a small one with sharp logits (conftest.make_small_model) saved as a hub-style folder,
    sampled at temperature 1.3, so some completions end before max_new_tokens (asserted) and padding,
    the temperature and every off-by-one matter far beyond the tolerances;
  - the prompts differ in length (left padding), and the reward depends on the completion and on the
    answer, so rows, groups and answers must line up;
  - every number is recomputed here without grpo.py, ppo.py or common.py: each row alone and unpadded
    (no masks, no position ids), log-probs by log_softmax, GAE by its sum, the losses by the papers'
    formulas, AdamW by its update rule, the learning rate by its warmup;
  - the run is seen from outside only: its dumps, its TensorBoard scalars, its final model, and two spies
    that change nothing: torch.nn.utils.clip_grad_norm_ (parameters and gradients at every optimizer
    step) and torch.randperm (PPO's minibatch order).
So a detached log-prob, a wrong mask or denominator, a gradient not zeroed, a swapped learning rate, a
scheduler stepped in the wrong place or a KL coefficient not fed back each fail here.
"""

import glob
import json
import math
import os
import statistics

import pytest
import torch
from conftest import make_small_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import grpo
import ppo
from machinery import models
from machinery.tiny_model import TINY_MODEL

EOS = 1  # the tiny tokenizer's <eos>, and make_small_model's eos_token_id
TEMPERATURE = 1.3
REWARD_SOURCE = '''
EXAMPLES = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in (0, 7, 12, 25, 133, 4096) for b in range(5)]


def reward(prompt, completion, answer):
    """Varies with the completion and the answer; special tokens shown in the text or not give the same."""
    text = completion.replace("<pad>", "").replace("<unk>", "")
    return ((sum(map(ord, text)) + 3 * int(answer)) % 11) / 10
'''
NAMESPACE = {}
exec(REWARD_SOURCE, NAMESPACE)
ANSWERS = {ex["prompt"]: ex["answer"] for ex in NAMESPACE["EXAMPLES"]}
reward = NAMESPACE["reward"]


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """(model folder, task name): a sharp 2-layer qwen2 over the tiny tokenizer's 25 tokens, and the task above."""
    folder = tmp_path_factory.mktemp("sharp")
    make_small_model(vocab_size=25, seed=2).save_pretrained(folder / "model")
    models.load_tokenizer(TINY_MODEL).save_pretrained(folder / "model")
    (folder / "varied_reward.py").write_text(REWARD_SOURCE)
    return str(folder / "model"), f"python:{folder / 'varied_reward.py'}:reward"


class Spy:
    """Records every clip_grad_norm_ call (parameters and gradients before the clip, the norm it returns)
    and every torch.randperm result, then lets the real function run: the run itself is unchanged."""

    def __init__(self, monkeypatch):
        self.calls, self.perms = [], []
        clip, randperm = torch.nn.utils.clip_grad_norm_, torch.randperm

        def spy_clip(parameters, max_norm, *args, **kwargs):
            params = list(parameters)
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
            call = dict(params=[p.detach().clone() for p in params], grads=grads, max_norm=max_norm)
            self.calls.append(call)
            norm = clip(params, max_norm, *args, **kwargs)
            call["norm"] = float(norm)
            return norm

        def spy_randperm(n, *args, **kwargs):
            perm = randperm(n, *args, **kwargs)
            self.perms.append(perm.clone())
            return perm

        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy_clip)
        monkeypatch.setattr(torch, "randperm", spy_randperm)


# ---------------------------------------------------------------------------------------------------
# The reference: one row at a time, no padding, no masks.
# ---------------------------------------------------------------------------------------------------


def rows_of(d):
    """[(prompt ids, completion ids up to and including the first EOS)], read from a dump without its masks."""
    rows = []
    batch = zip(d["prompt_ids"].tolist(), d["prompt_mask"].tolist(), d["completion_ids"].tolist())
    for prompt_ids, prompt_mask, completion_ids in batch:
        n_pad = prompt_mask.index(1)
        assert prompt_mask == [0] * n_pad + [1] * (len(prompt_mask) - n_pad)  # left padding
        assert prompt_ids[:n_pad] == [0] * n_pad and 0 not in prompt_ids[n_pad:]  # <pad> is id 0
        completion = []
        for token in completion_ids:
            completion.append(token)
            if token == EOS:
                break
        rows.append((prompt_ids[n_pad:], completion))
    return rows


def padded(values, T):
    """A list of per-row lists as one [N, T] tensor, zero after each row's end."""
    return torch.tensor([[float(v) for v in row] + [0.0] * (T - len(row)) for row in values])


def close(actual, expected, atol=1e-5):
    """To 1e-5: the reference's forward runs each row alone, unpadded, so summation orders differ."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1e-5, atol=atol)


def text_of(tokenizer, ids):
    """The characters of ids, the EOS left out; one token per character in the tiny tokenizer."""
    return "".join(tokenizer.convert_ids_to_tokens([t for t in ids if t != EOS]))


def row_forward(model, prompt, completion):
    """Log-probs [L] at TEMPERATURE of the completion's tokens, and the entropies [L] of the distributions (both
    with their gradients)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE  # position t predicts t + 1
    logprobs = torch.log_softmax(logits, -1)
    logp = logprobs[torch.arange(len(completion)), torch.tensor(completion)]
    return logp, -(logprobs.exp() * logprobs).sum(-1)


def row_values(critic, prompt, completion):
    """V of the prefix before each completion token [L]."""
    ids = torch.tensor([prompt + completion])
    return critic(input_ids=ids).logits[0, len(prompt) - 1 : -1, 0]


def set_params(model, params):
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [tuple(p.shape) for p in params], "the spied parameters are not this model's"
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    model.zero_grad(set_to_none=True)
    return model


def clipped_surrogate(ratio, advantage, clip_low, clip_high):
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) (Schulman et al. 2017, eq. 7, as a loss)."""
    return torch.maximum(-advantage * ratio, -advantage * ratio.clamp(1 - clip_low, 1 + clip_high))


def k3(logp, ref_logp):
    log_r = ref_logp - logp
    return log_r.exp() - 1 - log_r


def kl_penalty(logp, ref_logp, kind):
    log_r = ref_logp - logp
    return {"k1": -log_r, "k2": log_r**2 / 2, "k3": log_r.exp() - 1 - log_r}[kind]


class AdamW:
    """torch's AdamW update rule, with its defaults (betas 0.9, 0.999, eps 1e-8), one state per parameter."""

    def __init__(self, n, weight_decay):
        self.m, self.v, self.t, self.weight_decay = [0.0] * n, [0.0] * n, 0, weight_decay

    def step(self, params, grads, lrs):
        self.t += 1
        out = []
        for i, (p, g, lr) in enumerate(zip(params, grads, lrs)):
            p = p * (1 - lr * self.weight_decay)
            self.m[i] = 0.9 * self.m[i] + 0.1 * g
            self.v[i] = 0.999 * self.v[i] + 0.001 * g * g
            denom = (self.v[i].sqrt() / math.sqrt(1 - 0.999**self.t)) + 1e-8
            out.append(p - lr / (1 - 0.9**self.t) * self.m[i] / denom)
        return out


def clip_coef(grads, max_norm):
    norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    return norm, min(1.0, max_norm / (norm + 1e-6))


def assert_grads_close(actual, expected, what):
    scale = max(float(g.abs().max()) for g in expected)
    assert scale > 0, f"{what}: the reference gradient is 0"
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, rtol=1e-3, atol=2e-4 * scale, msg=lambda m: f"{what}, parameter {i}: {m}")


def assert_params_close(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-6, msg=lambda m: f"{what}, parameter {i}: {m}")


def lr_at(base, step, warmup_steps):
    """Linear warmup from 0: the rate of training step `step` (1-based)."""
    return base * min(1.0, step / (warmup_steps + 1))


def logged_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def check_scalar(scalars, tag, step, expected, rel=1e-4, abs=1e-6):
    assert tag in scalars, f"{tag} is not logged"
    assert scalars[tag][step] == pytest.approx(expected, rel=rel, abs=abs), f"{tag} at step {step}"


def final_params(run_dir, folder, like):
    """The saved model's parameters, in the order of the in-memory model `like` (shared weights once)."""
    weights = load_file(os.path.join(run_dir, folder, "model.safetensors"))
    names = [name for name, _ in like.named_parameters()]
    return [weights[name] for name in names]


def read_run(tmp_path):
    (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
    with open(tmp_path / "dump" / "metadata.json") as f:
        args = json.load(f)["args"]
    return run_dir, args


def dump_of(tmp_path, step):
    return load_file(str(tmp_path / "dump" / f"step{step:06d}.safetensors"))


def check_rollout(d, rows, per_prompt, tokenizer):
    """The layout (each prompt per_prompt times in a row) and masks: (rewards, whether both paddings occur)."""
    T = d["completion_ids"].shape[1]
    lengths = [len(c) for _, c in rows]
    assert torch.equal(d["completion_mask"].long(), padded([[1] * n for n in lengths], T).long())
    prompts = [text_of(tokenizer, p) for p, _ in rows]
    for i in range(0, len(rows), per_prompt):
        assert len(set(prompts[i : i + per_prompt])) == 1, f"rows {i}..{i + per_prompt - 1} do not share a prompt"
    rewards = [reward(p, text_of(tokenizer, c), ANSWERS[p]) for p, (_, c) in zip(prompts, rows)]
    return rewards, min(lengths) < T and (d["prompt_mask"] == 0).any()


# ---------------------------------------------------------------------------------------------------
# GRPO
# ---------------------------------------------------------------------------------------------------

GRPO_VARIANTS = {
    # The paper: group std, per-sequence token mean, the k3 term, two updates per batch, uneven micro-batches.
    "paper-mu2-kl": dict(
        scale_rewards="group",
        loss_agg="seq-mean-token-mean",
        beta=0.05,
        num_iterations=2,
        clip_low=0.2,
        clip_high=0.28,
        micro_batch_size=5,
        bias_corrected_kl=False,
    ),
    # GSPO: one ratio per completion (the mean over its real tokens), a tight clip, token mean.
    "gspo": dict(
        importance_level="sequence",
        scale_rewards="batch",
        loss_agg="token-mean",
        beta=0.0,
        num_iterations=2,
        clip_low=0.02,
        clip_high=0.03,
        micro_batch_size=4,
        learning_rate=3e-4,
    ),
    # Dr. GRPO: no std, a constant normaliser; one update per batch (ratio 1); the default bias-corrected k3.
    "dr-grpo": dict(
        scale_rewards="none", loss_agg="seq-mean-token-sum-norm", beta=0.1, num_iterations=1, micro_batch_size=12
    ),
}


def grpo_advantages(rewards, group_size, scale):
    """(r - group mean) / (std + 1e-4): the group's sample std, the batch's, or none (Dr. GRPO)."""
    out = []
    for i in range(0, len(rewards), group_size):
        group = rewards[i : i + group_size]
        mean = sum(group) / group_size
        std = {"group": statistics.stdev(group) + 1e-4, "batch": statistics.stdev(rewards) + 1e-4, "none": 1.0}[scale]
        out += [(r - mean) / std for r in group]
    return out


def grpo_loss(policy, rows, advantages, old_logps, ref_logps, a):
    """The GRPO loss of the whole batch and its per-row pieces, written from the papers, row by row."""
    per_token, pieces = [], dict(pg=[], kl=[], logratio=[], entropy=[], logp=[])
    for (prompt, completion), adv, old, ref in zip(rows, advantages, old_logps, ref_logps):
        logp, entropy = row_forward(policy, prompt, completion)
        logratio = logp - old
        if a["importance_level"] == "sequence":  # GSPO: exp of the mean log-ratio over the completion
            logratio = logratio.mean().expand(len(completion))
        pg = clipped_surrogate(logratio.exp(), adv, a["clip_low"], a["clip_high"])
        loss = pg
        if a["beta"] > 0:
            kl = k3(logp, ref)
            if a["bias_corrected_kl"]:  # TRL's and DeepSeek-V3.2's k3, weighted by the importance ratio
                kl = kl * logratio.exp()
            loss = pg + a["beta"] * kl
            pieces["kl"].append(kl.detach())
        per_token.append(loss)
        for key, value in (("pg", pg), ("logratio", logratio), ("entropy", entropy), ("logp", logp)):
            pieces[key].append(value.detach())
    N, n_tokens = len(rows), sum(len(c) for _, c in rows)
    if a["loss_agg"] == "seq-mean-token-mean":
        total = sum(t.mean() for t in per_token) / N
    elif a["loss_agg"] == "token-mean":
        total = sum(t.sum() for t in per_token) / n_tokens
    else:
        total = sum(t.sum() for t in per_token) / (N * a["max_new_tokens"])
    return total, per_token, pieces


def token_mean(pieces):
    flat = torch.cat(pieces)
    return float(flat.mean())


def clip_fraction(logratios, advantages, clip_low, clip_high):
    clipped = []
    for logratio, adv in zip(logratios, advantages):
        ratio = logratio.exp()
        clipped.append((((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))).float())
    return token_mean(clipped)


def approx_kl(logratios):
    return token_mean([lr.exp() - 1 - lr for lr in logratios])


@pytest.mark.slow
@pytest.mark.parametrize("variant", GRPO_VARIANTS)
def test_grpo_two_steps_match_the_reference(variant, sharp, tmp_path, monkeypatch):
    folder, task = sharp
    spy = Spy(monkeypatch)
    fields = dict(
        model=folder,
        preset="tiny",
        task=task,
        seed=5,
        num_steps=2,
        prompts_per_step=3,
        group_size=4,
        max_new_tokens=6,
        temperature=TEMPERATURE,
        learning_rate=1e-2,
        warmup_steps=1,
        max_grad_norm=0.5,
        sample_every=0,
        output_dir=str(tmp_path / "runs"),
        dump_dir=str(tmp_path / "dump"),
    )
    history = grpo.main(grpo.Args(**{**fields, **GRPO_VARIANTS[variant]}))
    monkeypatch.undo()
    run_dir, a = read_run(tmp_path)
    tokenizer = models.load_tokenizer(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()  # the initial weights: also the KL reference
    policy = AutoModelForCausalLM.from_pretrained(folder).eval()
    mu, G = a["num_iterations"], a["group_size"]
    assert len(spy.calls) == 2 * mu, "one optimizer step (one clip of the gradient) per iteration"
    assert_params_close(spy.calls[0]["params"], list(reference.parameters()), "the first update starts from the model")
    adam = AdamW(len(spy.calls[0]["params"]), a.get("weight_decay", 0.01))  # torch's default until the flag exists
    scalars = logged_scalars(run_dir)
    n_params = sum(p.numel() for p in reference.parameters())
    check_scalar(scalars, "charts/params_policy", 0, n_params)
    check_scalar(scalars, "charts/params_reference", 0, n_params if a["beta"] > 0 else 0)
    total_tokens, clipped_any = 0, False

    for step in (1, 2):
        d = dump_of(tmp_path, step)
        rows = rows_of(d)
        N, T = len(rows), a["max_new_tokens"]
        assert N == a["prompts_per_step"] * G
        rewards, early = check_rollout(d, rows, G, tokenizer)
        assert early or step > 1, "step 1 must have early EOS and left padding"
        close(d["rewards"], torch.tensor(rewards))
        assert history[step - 1] == pytest.approx(sum(rewards) / N, abs=1e-6)
        advantages = grpo_advantages(rewards, G, a["scale_rewards"])
        close(d["advantages"], torch.tensor(advantages))

        calls = spy.calls[(step - 1) * mu : step * mu]
        with torch.no_grad():
            set_params(policy, calls[0]["params"])  # the weights that sampled this step
            old_logps = [row_forward(policy, p, c)[0] for p, c in rows]
            ref_logps = [row_forward(reference, p, c)[0] for p, c in rows]
        if a["beta"] > 0:
            close(d["ref_logp"], padded(ref_logps, T))
        stats = dict(pg=[], kl=[], approx_kl=[], clipfrac=[], entropy=[])
        for iteration, call in enumerate(calls):
            set_params(policy, call["params"]).train()
            loss, per_token, pieces = grpo_loss(policy, rows, advantages, old_logps, ref_logps, a)
            loss.backward()
            grads = [p.grad for p in policy.parameters()]
            assert_grads_close(call["grads"], grads, f"step {step}, iteration {iteration + 1}: gradient of the loss")
            norm, coef = clip_coef(call["grads"], a["max_grad_norm"])
            assert call["norm"] == pytest.approx(norm, rel=1e-4)
            clipped_any |= coef < 1
            stats["pg"].append(token_mean(pieces["pg"]))
            stats["kl"].append(token_mean(pieces["kl"]) if pieces["kl"] else 0.0)
            stats["approx_kl"].append(approx_kl(pieces["logratio"]))
            stats["clipfrac"].append(clip_fraction(pieces["logratio"], advantages, a["clip_low"], a["clip_high"]))
            stats["entropy"].append(token_mean(pieces["entropy"]))
            if iteration == mu - 1:  # the dump holds the last pass
                close(d["new_logp"], padded([x.tolist() for x in pieces["logp"]], T))
                close(d["old_logp"], padded([x.tolist() for x in (old_logps if mu > 1 else pieces["logp"])], T))
                close(d["per_token_loss"], padded([x.tolist() for x in per_token], T))
                close(d["loss"], loss.detach())
            # The optimizer step: the clipped gradient, AdamW, the warmed-up rate of this step.
            lr = lr_at(a["learning_rate"], step, a["warmup_steps"])
            after = adam.step(call["params"], [g * coef for g in call["grads"]], [lr] * len(grads))
            k = (step - 1) * mu + iteration + 1
            following = spy.calls[k]["params"] if k < len(spy.calls) else final_params(run_dir, "final", policy)
            assert_params_close(following, after, f"step {step}, iteration {iteration + 1}: the weights after AdamW")

        # What is logged means what docs/logs.md says.
        lengths = [len(c) for _, c in rows]
        total_tokens += int(d["prompt_mask"].sum()) + sum(lengths)
        check_scalar(scalars, "charts/score", step, sum(rewards) / N)
        assert "charts/reward" not in scalars  # GRPO's reward is the score: logged once, as charts/score
        check_scalar(scalars, "charts/reward_std", step, statistics.stdev(rewards))
        check_scalar(scalars, "charts/completion_length", step, sum(lengths) / N)
        check_scalar(scalars, "losses/policy_loss", step, sum(stats["pg"]) / mu, abs=1e-5)
        check_scalar(scalars, "losses/approx_kl", step, sum(stats["approx_kl"]) / mu, abs=1e-5)
        check_scalar(scalars, "losses/clipfrac", step, sum(stats["clipfrac"]) / mu, abs=1e-5)
        check_scalar(scalars, "losses/entropy", step, sum(stats["entropy"]) / mu, abs=1e-5)
        check_scalar(scalars, "losses/grad_norm", step, calls[-1]["norm"])
        if a["beta"] > 0:
            check_scalar(scalars, "losses/kl_ref", step, sum(stats["kl"]) / mu, abs=1e-5)
        else:
            assert "losses/kl_ref" not in scalars
        seconds = scalars["perf/rollout_seconds"][step] + scalars["perf/train_seconds"][step]
        assert scalars["perf/tokens_per_second"][step] * seconds == pytest.approx(total_tokens, rel=1e-4)
    assert clipped_any or variant == "dr-grpo", "max_grad_norm must clip some step, or the clip is not tested"
    if mu > 1:
        assert max(stats["clipfrac"]) > 0, "the second iteration must clip some ratio, or the clip is not tested"


# ---------------------------------------------------------------------------------------------------
# PPO
# ---------------------------------------------------------------------------------------------------

PPO_VARIANTS = {
    # k2 penalty, missing-EOS penalty, gamma and lambda below 1, uneven micro-batches (3 + 1 per minibatch of 4).
    "k2-eos-penalty": dict(
        kl_coef=0.1,
        kl_estimator="k2",
        missing_eos_penalty=0.3,
        gamma=0.9,
        lam=0.8,
        vf_coef=0.5,
        cliprange_value=0.05,
        micro_batch_size=3,
    ),
    # The adaptive controller (Ziegler et al. 2019) on the k1 penalty, with a short horizon so it moves.
    # One epoch of 4 minibatches of 2 rows (micro-batches of 4: one per minibatch).
    "k1-target-kl": dict(
        kl_coef=0.05,
        kl_estimator="k1",
        target_kl=0.5,
        kl_horizon=40,
        missing_eos_penalty=0.0,
        gamma=1.0,
        lam=0.95,
        vf_coef=0.1,
        cliprange_value=0.2,
        micro_batch_size=4,
        update_epochs=1,
        num_minibatches=4,
    ),
    # The entropy bonus in the loss (Schulman et al. 2017, eq. 9), with its gradient, over two micro-batches.
    "entropy-bonus": dict(ent_coef=0.5, micro_batch_size=2, max_grad_norm=0.02),
    # No reference model: no penalty at all. Three epochs of 2 minibatches.
    "no-reference": dict(
        kl_coef=0.0,
        missing_eos_penalty=0.3,
        gamma=1.0,
        lam=1.0,
        vf_coef=0.2,
        cliprange_value=0.1,
        micro_batch_size=2,
        update_epochs=3,
    ),
}


class ReferenceCritic(torch.nn.Module):
    """A backbone (AutoModel) and a linear head on every position: V(prefix up to and including this token)."""

    def __init__(self, folder):
        super().__init__()
        from transformers import AutoModel

        self.backbone = AutoModel.from_pretrained(folder)
        self.head = torch.nn.Linear(self.backbone.config.hidden_size, 1)

    def forward(self, input_ids):
        return self.head(self.backbone(input_ids=input_ids).last_hidden_state)[..., 0]


def row_critic_values(critic, prompt, completion):
    """V of the prefix before each completion token [L]: the position that predicts it, as for log-probs."""
    return critic(torch.tensor([prompt + completion]))[0, len(prompt) - 1 : -1]


def gae_by_sums(rewards, values, gamma, lam):
    """A_t = sum_k (gamma lam)^(k - t) delta_k over the row's own tokens, V after the end 0 (Schulman et al. 2016)."""
    L = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < L else 0.0) - values[t] for t in range(L)]
    return [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, L)) for t in range(L)]


def population_var(xs):
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / len(xs)


def ppo_minibatch_loss(policy, critic, rows, idx, old, adv, values, returns, a):
    """Token mean over the minibatch of the clipped surrogate + vf_coef * the clipped value loss, and its pieces."""
    per_token, pieces = [], dict(pg=[], vloss=[], logratio=[], adv=[], vclipped=[], entropy=[], logp=[], values=[])
    for i in idx:
        prompt, completion = rows[i]
        logp, entropy = row_forward(policy, prompt, completion)
        new_values = row_critic_values(critic, prompt, completion)
        logratio = logp - old[i]
        pg = clipped_surrogate(logratio.exp(), adv[i], a["clip_low"], a["clip_high"])
        c = a["cliprange_value"]
        v_clipped = values[i] + (new_values - values[i]).clamp(-c, c)
        vloss = 0.5 * torch.maximum((new_values - returns[i]) ** 2, (v_clipped - returns[i]) ** 2)
        per_token.append(pg + a["vf_coef"] * vloss - a["ent_coef"] * entropy)  # the entropy bonus, eq. 9
        vclipped = ((new_values - values[i]).abs() > c).float()
        for key, value in (
            ("pg", pg),
            ("vloss", vloss),
            ("logratio", logratio),
            ("adv", adv[i]),
            ("entropy", entropy),
            ("vclipped", vclipped),
            ("logp", logp),
            ("values", new_values),
        ):
            pieces[key].append(value.detach())
    loss = sum(t.sum() for t in per_token) / sum(len(t) for t in per_token)
    return loss, per_token, pieces


@pytest.mark.slow
@pytest.mark.parametrize("variant", PPO_VARIANTS)
def test_ppo_two_steps_match_the_reference(variant, sharp, tmp_path, monkeypatch):
    folder, task = sharp
    spy = Spy(monkeypatch)
    fields = dict(
        model=folder,
        preset="tiny",
        task=task,
        seed=4,
        num_steps=2,
        prompts_per_step=4,
        samples_per_prompt=2,
        max_new_tokens=6,
        temperature=TEMPERATURE,
        learning_rate=3e-3,
        critic_learning_rate=1e-2,
        warmup_steps=1,
        max_grad_norm=0.1,
        update_epochs=2,
        num_minibatches=2,
        clip_low=0.1,
        clip_high=0.15,
        sample_every=0,
        output_dir=str(tmp_path / "runs"),
        dump_dir=str(tmp_path / "dump"),
    )
    history = ppo.main(ppo.Args(**{**fields, **PPO_VARIANTS[variant]}))
    monkeypatch.undo()
    run_dir, a = read_run(tmp_path)
    tokenizer = models.load_tokenizer(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    policy = AutoModelForCausalLM.from_pretrained(folder).eval()
    critic = ReferenceCritic(folder).eval()
    n_policy = len(list(policy.parameters()))
    E, K, N = a["update_epochs"], a["num_minibatches"], a["prompts_per_step"] * a["samples_per_prompt"]
    M = N // K
    assert len(spy.calls) == 2 * 2 * E * K, "two clips (policy, critic) per optimizer step"
    perms = [p.tolist() for p in spy.perms if len(p) == N]
    assert len(perms) == 2 * E and all(sorted(p) == list(range(N)) for p in perms), (
        "one permutation of the batch per epoch"
    )
    assert_params_close(spy.calls[0]["params"], list(reference.parameters()), "the first update starts from the model")
    adam = AdamW(len(spy.calls[0]["params"]) + len(spy.calls[1]["params"]), a.get("weight_decay", 0.01))
    scalars = logged_scalars(run_dir)
    use_ref = a["kl_coef"] > 0 or a["target_kl"] is not None
    n_params = sum(p.numel() for p in reference.parameters())
    check_scalar(scalars, "charts/params_policy", 0, n_params)
    check_scalar(scalars, "charts/params_critic", 0, sum(p.numel() for p in critic.parameters()))
    check_scalar(scalars, "charts/params_reference", 0, n_params if use_ref else 0)
    kl_coef, clipped_policy, clipped_critic = a["kl_coef"], False, False

    for step in (1, 2):
        d = dump_of(tmp_path, step)
        rows = rows_of(d)
        T = a["max_new_tokens"]
        assert len(rows) == N
        scores, early = check_rollout(d, rows, a["samples_per_prompt"], tokenizer)
        assert early or step > 1, "step 1 must have early EOS and left padding"
        close(d["scores"], torch.tensor(scores))
        assert history[step - 1] == pytest.approx(sum(scores) / N, abs=1e-6)

        calls = spy.calls[(step - 1) * 2 * E * K : step * 2 * E * K]
        with torch.no_grad():
            set_params(policy, calls[0]["params"])  # the weights that sampled this step
            set_params(critic, calls[1]["params"])
            old = [row_forward(policy, p, c)[0] for p, c in rows]
            ref = [row_forward(reference, p, c)[0] for p, c in rows] if use_ref else old
            values = [row_critic_values(critic, p, c) for p, c in rows]
        close(d["old_logp"], padded([x.tolist() for x in old], T))
        close(d["ref_logp"], padded([x.tolist() for x in ref], T))
        close(d["values"], padded([x.tolist() for x in values], T))

        # The reward: -kl_coef * KL per token, and the score (less the missing-EOS penalty) on the last real token.
        assert d["kl_coef"].item() == pytest.approx(kl_coef, rel=1e-6)
        kls = [kl_penalty(o, r, a["kl_estimator"]).tolist() for o, r in zip(old, ref)]
        rewards = []
        for (_, completion), score, kl in zip(rows, scores, kls):
            row = [-kl_coef * k for k in kl]
            row[-1] += score - (a["missing_eos_penalty"] if completion[-1] != EOS else 0.0)
            rewards.append(row)
        close(d["rewards"], padded(rewards, T))
        advantages = [gae_by_sums(r, v.tolist(), a["gamma"], a["lam"]) for r, v in zip(rewards, values)]
        returns = [[x + v for x, v in zip(adv, val.tolist())] for adv, val in zip(advantages, values)]
        close(d["returns"], padded(returns, T))
        flat = [x for row in advantages for x in row]
        mean, std = sum(flat) / len(flat), math.sqrt(population_var(flat) + 1e-8)
        whitened = [torch.tensor([(x - mean) / std for x in row]) for row in advantages]
        close(d["advantages"], padded([w.tolist() for w in whitened], T))
        returns = [torch.tensor(r) for r in returns]

        stats = {k: [] for k in ("pg", "vloss", "approx_kl", "clipfrac", "clipfrac_value", "entropy")}
        for u in range(E * K):
            policy_call, critic_call = calls[2 * u], calls[2 * u + 1]
            epoch, k = divmod(u, K)
            idx = perms[(step - 1) * E + epoch][k * M : (k + 1) * M]
            set_params(policy, policy_call["params"]).train()
            set_params(critic, critic_call["params"]).train()
            loss, per_token, pieces = ppo_minibatch_loss(policy, critic, rows, idx, old, whitened, values, returns, a)
            loss.backward()
            where = f"step {step}, epoch {epoch + 1}, minibatch {k + 1}"
            assert_grads_close(policy_call["grads"], [p.grad for p in policy.parameters()], f"{where}: policy gradient")
            assert_grads_close(critic_call["grads"], [p.grad for p in critic.parameters()], f"{where}: critic gradient")
            if u == E * K - 1:  # the dump holds the first micro-batch of the last minibatch of the last epoch
                assert d["minibatch_index"].tolist() == idx
                micro = d["micro_index"]
                n = len(micro)
                assert micro.tolist() == idx[:n]
                close(d["new_logp"], padded([x.tolist() for x in pieces["logp"][:n]], T))
                close(d["new_values"], padded([x.tolist() for x in pieces["values"][:n]], T))
                close(d["per_token_loss"], padded([x.tolist() for x in per_token[:n]], T))
                mb_tokens = sum(len(x) for x in per_token)
                close(d["loss"], sum(x.sum() for x in per_token[:n]).detach() / mb_tokens)
            stats["pg"].append(token_mean(pieces["pg"]))
            stats["vloss"].append(token_mean(pieces["vloss"]))
            stats["approx_kl"].append(approx_kl(pieces["logratio"]))
            clipped = [
                ((lr.exp() < 1 - a["clip_low"]) & (x < 0)) | ((lr.exp() > 1 + a["clip_high"]) & (x > 0))
                for lr, x in zip(pieces["logratio"], pieces["adv"])
            ]
            stats["clipfrac"].append(token_mean([c.float() for c in clipped]))
            stats["clipfrac_value"].append(token_mean(pieces["vclipped"]))
            stats["entropy"].append(token_mean(pieces["entropy"]))
            # The optimizer step: each model's gradient clipped on its own, one AdamW, two learning rates.
            norm, coef = clip_coef(policy_call["grads"], a["max_grad_norm"])
            assert policy_call["norm"] == pytest.approx(norm, rel=1e-4)
            critic_norm, critic_coef = clip_coef(critic_call["grads"], a["max_grad_norm"])
            assert critic_call["norm"] == pytest.approx(critic_norm, rel=1e-4)
            clipped_policy |= coef < 1
            clipped_critic |= critic_coef < 1
            lrs = [lr_at(a["learning_rate"], step, a["warmup_steps"])] * n_policy
            lrs += [lr_at(a["critic_learning_rate"], step, a["warmup_steps"])] * len(critic_call["params"])
            clipped_grads = [g * coef for g in policy_call["grads"]] + [g * critic_coef for g in critic_call["grads"]]
            after = adam.step(policy_call["params"] + critic_call["params"], clipped_grads, lrs)
            j = (step - 1) * 2 * E * K + 2 * u + 2
            if j < len(spy.calls):
                assert_params_close(spy.calls[j]["params"], after[:n_policy], f"{where}: the policy after AdamW")
                assert_params_close(spy.calls[j + 1]["params"], after[n_policy:], f"{where}: the critic after AdamW")
            else:  # what the run saved is the trained policy and critic
                assert_params_close(final_params(run_dir, "final", policy), after[:n_policy], "the final policy")
                saved_critic = list(ppo.load_critic(os.path.join(run_dir, "critic"), torch.device("cpu")).parameters())
                assert_params_close(saved_critic, after[n_policy:], "the saved critic")

        # What is logged means what docs/logs.md says.
        row_totals = [sum(r) for r in rewards]
        check_scalar(scalars, "charts/score", step, sum(scores) / N)
        check_scalar(scalars, "charts/reward", step, sum(row_totals) / N)
        check_scalar(scalars, "charts/reward_std", step, statistics.stdev(row_totals))
        check_scalar(scalars, "charts/completion_length", step, sum(len(c) for _, c in rows) / N)
        check_scalar(scalars, "charts/kl_coef", step, kl_coef)
        tags = dict(
            policy_loss="pg",
            value_loss="vloss",
            approx_kl="approx_kl",
            clipfrac="clipfrac",
            clipfrac_value="clipfrac_value",
            entropy="entropy",
        )
        for tag, key in tags.items():
            check_scalar(scalars, f"losses/{tag}", step, sum(stats[key]) / (E * K), abs=1e-5)
        check_scalar(scalars, "losses/grad_norm", step, calls[-2]["norm"])
        flat_values = [x for v in values for x in v.tolist()]
        flat_returns = [x for r in returns for x in r.tolist()]
        ev = 1 - population_var([r - v for r, v in zip(flat_returns, flat_values)]) / population_var(flat_returns)
        check_scalar(scalars, "losses/explained_variance", step, ev, abs=1e-5)
        flat_kl = [x for row in kls for x in row]
        if use_ref:
            check_scalar(scalars, "losses/kl_ref", step, sum(flat_kl) / len(flat_kl), abs=1e-6)
        else:
            assert "losses/kl_ref" not in scalars
        if a["target_kl"] is not None:  # the controller, fed the summed KL (k1) per completion of this step
            k1 = [kl_penalty(o, r, "k1").sum().item() for o, r in zip(old, ref)]
            error = min(max(sum(k1) / N / a["target_kl"] - 1, -0.2), 0.2)
            kl_coef *= 1 + error * N / a["kl_horizon"]
    assert clipped_policy and clipped_critic, (
        "max_grad_norm must clip some step of each model, or the clip is not tested"
    )
    if a["target_kl"] is not None:
        assert kl_coef != a["kl_coef"]
