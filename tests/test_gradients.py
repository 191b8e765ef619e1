"""The gradient each loop applies, against autograd of the loss written out here from the paper's formulas.

The loops' gradients are caught where they are clipped (after the last micro-batch, before the optimizer step),
with the weights they were computed at. The expected ones are recomputed here on each completion alone (no
padding, no micro-batches), from those weights, the dumped batch and a loss written independently of grpo.py
and ppo.py: a loop that drops a micro-batch, detaches a term or clips around the wrong value shows.
"""

import pytest
import torch
from safetensors.torch import load_file

import grpo
import ppo
from machinery import models

CPU = torch.device("cpu")


@pytest.fixture
def clipped(monkeypatch):
    """[(weights, gradients)] of every clip_grad_norm_ call, in order, each a list over the parameters."""
    calls, clip = [], torch.nn.utils.clip_grad_norm_

    def record(parameters, *args, **kwargs):
        parameters = list(parameters)
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in parameters]
        calls.append(([p.detach().clone() for p in parameters], grads))
        return clip(parameters, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", record)
    return calls


def with_weights(model, weights):
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    return model.train()


def rows(d):
    """Each completion alone: (its real prompt + completion ids [1, L], its completion's length T)."""
    for i in range(len(d["completion_mask"])):
        prompt = d["prompt_ids"][i][d["prompt_mask"][i].bool()]
        completion = d["completion_ids"][i][d["completion_mask"][i].bool()]
        yield torch.cat([prompt, completion])[None], len(completion)


def row_logprobs(policy, ids, T, temperature):
    logits = policy(input_ids=ids).logits[0, -T - 1 : -1].float() / temperature  # position t predicts t + 1
    return torch.log_softmax(logits, -1).gather(1, ids[0, -T:, None])[:, 0]  # [T]


def row_values(critic, ids, T):
    hidden = critic.backbone(input_ids=ids).last_hidden_state[0, -T - 1 : -1]  # the state before each token
    return critic.value_head(hidden)[:, 0].float()


def flat(grads):
    return torch.cat([g.flatten() for g in grads])


def assert_close(actual, expected, rel=1e-4):
    err = (actual - expected).abs().max().item()
    assert err <= rel * expected.abs().max().item(), f"max difference {err:.2e} of {expected.abs().max().item():.2e}"


# ---------------------------------------------------------------------------------------------------
# GRPO: the k3 term by importance weighting, every loss aggregation, micro-batches of 5, 5 and 2 completions.
# ---------------------------------------------------------------------------------------------------


def grpo_expected_gradient(policy, old_policy, d, args):
    """DeepSeekMath eq. 3 with k3 (times the ratio: the importance-weighted estimator of KL under the old
    policy, whose gradient is kl * grad log p + ratio * grad k3), aggregated as --loss-agg says."""
    r = d["rewards"].view(-1, args.group_size)
    advantages = ((r - r.mean(1, keepdim=True)) / (d["rewards"].std() + 1e-4)).view(-1)  # --scale-rewards batch
    policy.zero_grad()
    per_row, lengths = [], []
    for i, (ids, T) in enumerate(rows(d)):
        logp = row_logprobs(policy, ids, T, args.temperature)
        old = logp.detach()  # mu = 1: the old policy is the current one
        if args.num_iterations > 1:
            old = row_logprobs(old_policy, ids, T, args.temperature).detach()
        ref = d["ref_logp"][i, :T]
        ratio = torch.exp(logp - old)
        clipped_ratio = ratio.clamp(1 - args.clip_low, 1 + args.clip_high)
        surrogate = torch.minimum(ratio * advantages[i], clipped_ratio * advantages[i])
        k3 = torch.exp(ref - logp) - 1 - (ref - logp)
        kl = ratio * k3 if args.bias_corrected_kl else k3
        per_row.append((-surrogate + args.beta * kl).sum())
        lengths.append(T)
    n = len(per_row)
    if args.loss_agg == "seq-mean-token-mean":
        loss = sum(s / t for s, t in zip(per_row, lengths)) / n
    elif args.loss_agg == "token-mean":
        loss = sum(per_row) / sum(lengths)
    else:
        loss = sum(per_row) / (n * args.max_new_tokens)
    loss.backward()
    return flat(p.grad for p in policy.parameters())


@pytest.mark.parametrize(
    "flags",
    [
        dict(loss_agg="seq-mean-token-mean"),
        dict(loss_agg="token-mean"),
        dict(loss_agg="seq-mean-token-sum-norm"),
        dict(loss_agg="token-mean", num_iterations=2, bias_corrected_kl=False, clip_low=0.05, clip_high=0.1),
        dict(loss_agg="seq-mean-token-mean", num_iterations=2, clip_low=0.05, clip_high=0.1),
    ],
    ids=["seq-mean-token-mean", "token-mean", "sum-norm", "mu2-paper-k3", "mu2-bias-corrected"],
)
def test_grpo_gradient_over_micro_batches_is_the_whole_batch_loss_gradient(flags, tmp_path, clipped):
    """Step 2 (the policy has moved from the reference, so the KL term has a gradient), 12 completions (3 prompts in
    groups of 4) in micro-batches of 5, 5 and 2; with --num-iterations 2 the second iteration, whose ratios are not
    1. The reward (distinct characters written) has many values, so every group's advantages differ from another
    grouping's."""
    reward = tmp_path / "distinct.py"
    reward.write_text(
        'EXAMPLES = [{"prompt": f"{i}=", "answer": ""} for i in range(100)]\n'
        "def reward(prompt, completion, answer):\n    return len(set(completion)) / 4\n"
    )
    args = grpo.Args(
        seed=2,
        task=f"python:{reward}:reward",
        num_steps=2,
        prompts_per_step=3,
        group_size=4,
        max_new_tokens=4,
        beta=0.5,
        learning_rate=3e-2,
        micro_batch_size=5,
        sample_every=0,
        output_dir=str(tmp_path / "runs"),
        dump_dir=str(tmp_path / "dump"),
        **flags,
    )
    grpo.main(args)
    d = load_file(str(tmp_path / "dump" / "step000002.safetensors"))
    assert d["rewards"].view(-1, 4).std(1).gt(0).all()  # each group's rewards differ: the surrogate has a gradient
    mu = args.num_iterations
    assert len(clipped) == 2 * mu
    policy = with_weights(models.load_causal_lm(args.model, CPU), clipped[-1][0])
    old_policy = with_weights(models.load_causal_lm(args.model, CPU), clipped[mu][0])  # step 2's first iteration
    expected = grpo_expected_gradient(policy, old_policy, d, args)
    assert_close(flat(clipped[-1][1]), expected)
    if mu == 1:  # the k3 term's gradient is in it: without beta the gradient differs
        without_kl = grpo_expected_gradient(policy, old_policy, d, grpo.Args(**{**vars(args), "beta": 0.0}))
        assert (expected - without_kl).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------------
# PPO: every optimizer step of two epochs, clip and value clip acting on both sides, micro-batches of one.
# ---------------------------------------------------------------------------------------------------


def ppo_row_gradients(policy, critic, old_policy, old_critic, d, args, stats):
    """Per completion: the gradient of sum_t [PPO-clip loss + vf_coef * clipped value loss] (PPO2 baselines),
    and its real token count; `stats` gathers where the clips acted."""
    out = []
    for i, (ids, T) in enumerate(rows(d)):
        policy.zero_grad()
        critic.zero_grad()
        with torch.no_grad():
            old, old_values = row_logprobs(old_policy, ids, T, args.temperature), row_values(old_critic, ids, T)
        logp, values = row_logprobs(policy, ids, T, args.temperature), row_values(critic, ids, T)
        A, R = d["advantages"][i, :T], d["returns"][i, :T]
        ratio = torch.exp(logp - old)
        pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - args.clip_low, 1 + args.clip_high))
        c = args.cliprange_value
        clipped_values = old_values + (values - old_values).clamp(-c, c)
        v = 0.5 * torch.maximum((values - R) ** 2, (clipped_values - R) ** 2)
        (pg + args.vf_coef * v).sum().backward()
        moved, value_clipped = (values - old_values).detach(), ((clipped_values - R) ** 2 > (values - R) ** 2)
        stats.update(
            above=stats["above"] or bool(((ratio > 1 + args.clip_high) & (A > 0)).any()),
            below=stats["below"] or bool(((ratio < 1 - args.clip_low) & (A < 0)).any()),
            v_up=stats["v_up"] or bool((value_clipped & (moved > c)).any()),
            v_down=stats["v_down"] or bool((value_clipped & (moved < -c)).any()),
        )
        parameters = [*policy.parameters(), *critic.parameters()]
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in parameters]
        out.append((flat(grads), T))
    return out


def test_ppo_every_update_is_the_gradient_of_a_reshuffled_minibatch(tmp_path, clipped, monkeypatch):
    """6 completions, 3 minibatches of 2 (set apart from --update-epochs 2), micro-batches of 1. Each of the 6
    optimizer steps must apply the gradient of the pair of completions its epoch's permutation gives (and of no
    other pair), each epoch must draw its own permutation, and their minibatches must differ."""
    permutations, randperm = [], torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda *a, **k: permutations.append(randperm(*a, **k)) or permutations[-1])
    reward = tmp_path / "signs.py"  # returns of both signs, so values move up and down towards them
    reward.write_text(
        'EXAMPLES = [{"prompt": f"{i}=", "answer": ""} for i in range(100)]\n'
        "def reward(prompt, completion, answer):\n"
        "    return 0.5 if ord((completion or 'a')[0]) % 2 else -0.5\n"
    )
    args = ppo.Args(
        seed=4,
        num_steps=1,
        prompts_per_step=6,
        max_new_tokens=4,
        update_epochs=2,
        num_minibatches=3,
        micro_batch_size=1,
        learning_rate=3e-2,
        critic_learning_rate=1e-3,
        clip_low=0.02,
        clip_high=0.03,
        cliprange_value=0.01,
        vf_coef=0.5,
        missing_eos_penalty=0.0,
        task=f"python:{reward}:reward",
        sample_every=0,
        output_dir=str(tmp_path / "runs"),
        dump_dir=str(tmp_path / "dump"),
    )
    ppo.main(args)
    d = load_file(str(tmp_path / "dump" / "step000001.safetensors"))
    policy = models.load_causal_lm(args.model, CPU)
    n_policy, n_flat = len(list(policy.parameters())), sum(p.numel() for p in policy.parameters())
    pairs_of_calls = zip(clipped[0::2], clipped[1::2])  # each update clips the policy, then the critic
    updates = [(pol[0] + crit[0], pol[1] + crit[1]) for pol, crit in pairs_of_calls]  # (weights, gradients)
    epochs = [p.tolist() for p in permutations if len(p) == 6]
    assert len(epochs) == args.update_epochs and len(updates) == args.update_epochs * args.num_minibatches
    pairs = [tuple(sorted(perm[i : i + 2])) for perm in epochs for i in (0, 2, 4)]
    assert {frozenset(p) for p in pairs[:3]} != {frozenset(p) for p in pairs[3:]}, f"both epochs drew {pairs[:3]}"
    make = lambda weights: (
        with_weights(models.load_causal_lm(args.model, CPU), weights[:n_policy]),
        with_weights(ppo.load_critic(args.model, CPU), weights[n_policy:]),
    )
    old_policy, old_critic = make(updates[0][0])
    stats = dict(above=False, below=False, v_up=False, v_down=False)
    for (weights, applied), pair in zip(updates, pairs):
        per_row = ppo_row_gradients(*make(weights), old_policy, old_critic, d, args, stats)
        expected = sum(per_row[i][0] for i in pair) / sum(per_row[i][1] for i in pair)
        # the policy's and the critic's gradients, each to its own scale: neither hides in the other's
        assert_close(flat(applied[:n_policy]), expected[:n_flat])
        assert_close(flat(applied[n_policy:]), expected[n_flat:])
    assert all(stats.values()), stats  # both clips took the gradient away, on both sides
