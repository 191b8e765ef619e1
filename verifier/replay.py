"""verify.py's checks that need the weights: the run replayed from --model with this project's loss and AdamW
(every GRPO iteration, every PPO minibatch), each replay checked against the stored log-probs before the adapter's
log-probs, gradient and optimizer are compared on it.
"""

import copy

import torch

from common import select_rows
from verifier.report import EARLY, AdapterError, call, compare, loss_conditions, one_line, ppo_micro_batch, whole_batch


def gradients(loss_fn, models):
    for model in models:
        model.zero_grad(set_to_none=True)
        model.train()
    loss_fn().backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for m in models for p in m.parameters()]
    return torch.cat([g.flatten() for g in grads])


def adapter_gradients(adapter, models, batch, args):
    """The gradient of the adapter's train_loss, or None and why it was skipped."""
    for model in models:
        model.zero_grad(set_to_none=True)
        model.train()
    out, why = call(adapter, "train_loss", models[0], batch, args, *models[1:])
    if out is None:
        return None, why
    if not (torch.is_tensor(out) and out.numel() == 1 and out.requires_grad):
        what = f"a tensor of shape {tuple(out.shape)}" if torch.is_tensor(out) else type(out).__name__
        what += "" if not torch.is_tensor(out) or out.requires_grad else " without autograd (requires_grad False)"
        raise AdapterError(
            f"adapter {adapter.label!r}: train_loss() returned {what}: return the scalar loss tensor "
            "before .item() or .detach()"
        )
    try:
        out.reshape(()).backward()
    except Exception as e:
        raise AdapterError(
            f"adapter {adapter.label!r}: train_loss()'s backward raised {type(e).__name__}: {one_line(e)}"
        ) from None
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for m in models for p in m.parameters()]
    return torch.cat([g.flatten() for g in grads]), None


def check_logprobs(report, adapter, ref, step, model, batch, expected, what, initial=None, args=None):
    """The adapter's log-probs from `model` against the stored ones (and from the reference, `initial`)."""
    mask = batch["completion_mask"]
    with torch.no_grad():
        theirs, why = call(adapter, "token_logprobs", copy.deepcopy(model).eval(), batch, args)
        compare(report, "log-probs", step, adapter, "token_logprobs", theirs, expected, mask, what)
        if theirs is not None and initial is not None and "ref_logp" in batch:
            reference, _ = call(adapter, "token_logprobs", copy.deepcopy(initial).eval(), batch, args)
            compare(
                report, "log-probs", step, adapter, "token_logprobs", reference, batch["ref_logp"], mask, "ref_logp"
            )
    report.skip("log-probs", why)
    report.exercise("log-probs", "left padding (prompts of different lengths)", (batch["prompt_mask"] == 0).any())
    report.exercise("log-probs", EARLY, (mask[:, -1] == 0).any())
    report.exercise("log-probs", "a temperature other than 1", args["temperature"] != 1)


def check_gradient(report, adapter, ref, step, batch, args, models):
    if not hasattr(adapter, "train_loss"):
        return report.skip("gradient", "adapter has no train_loss()")
    ours = gradients(lambda: ref.train_loss(models[0], batch, args, *models[1:]), models)
    theirs, why = adapter_gradients(adapter, [copy.deepcopy(m) for m in models], batch, args)
    if theirs is not None:
        report.add("gradient", step, theirs, ours)
        loss_conditions(report, ["gradient"], ref, batch, args)
    if args["script"] == "grpo":
        report.exercise("update", "the gradient's norm clipped", ours.norm() > args["max_grad_norm"])
    report.skip("gradient", why)


def replayed_miss(ref, model, batch, expected, args):
    with torch.no_grad():
        ours = ref.token_logprobs(model.eval(), batch, args)
    return (ours - expected)[batch["completion_mask"].bool()].abs().max().item()


def replay_grpo(ref, policy, opt, d, args, iterations):
    """`iterations` of grpo.py's optimizer steps on this step's batch, micro-batch by micro-batch."""
    batch, N, size = whole_batch(d, args), len(d["completion_mask"]), args["micro_batch_size"]
    policy.train()
    for _ in range(iterations):
        opt.zero_grad(set_to_none=True)
        for i in range(0, N, size):
            ref.train_loss(policy, select_rows(batch, slice(i, i + size)), args).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), args["max_grad_norm"])
        opt.step()


def replay_ppo_update(ref, opt, policy, critic, batch, minibatch, args):
    """One of ppo.py's optimizer steps: the minibatch's micro-batches, each model's gradient clipped apart."""
    trained = [model for model in (policy, critic) if model is not None]  # --vf-coef 0: no critic
    for model in trained:
        model.train()
    opt.zero_grad(set_to_none=True)
    tokens, size = int(batch["completion_mask"][minibatch].sum()), args["micro_batch_size"]
    for i in range(0, len(minibatch), size):
        micro = dict(select_rows(batch, minibatch[i : i + size]), num_tokens=tokens)
        ref.train_loss(policy, micro, args, critic).backward()
    for model in trained:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args["max_grad_norm"])
    opt.step()


def check_grpo_weights(report, adapter, ref, steps, args, initial, tol, notes):
    policy, mu = copy.deepcopy(initial), args["num_iterations"]
    opt, scheduler = ref.optimizer(policy, args)
    for step in sorted(steps):
        d = steps[step]
        if step > 1:  # the replayed weights must give what the run stored, or the checks below mean nothing
            miss = replayed_miss(ref, policy, whole_batch(d, args), d["old_logp" if mu > 1 else "new_logp"], args)
            if step - 1 not in steps or miss > tol:
                notes.append(f"weights replayed to step {step} miss its log-probs by {miss:.1e}: checks stop")
                break
        replay_grpo(ref, policy, opt, d, args, mu - 1)  # the dump holds the last iteration
        batch = whole_batch(d, args)
        check_logprobs(report, adapter, ref, step, policy, batch, d.get("new_logp"), "new_logp", initial, args)
        check_gradient(report, adapter, ref, step, batch, args, [policy])
        replay_grpo(ref, policy, opt, d, args, 1)
        scheduler.step()


def check_ppo_weights(report, adapter, ref, steps, args, initial, critic, tol, notes):
    policy, critic = copy.deepcopy(initial), copy.deepcopy(critic)
    opt, scheduler = ref.optimizer(policy, args, critic)
    for step in sorted(steps):
        d, batch = steps[step], whole_batch(steps[step], args)
        miss = replayed_miss(ref, policy, batch, d["old_logp"], args)
        if step > 1 and (step - 1 not in steps or miss > tol):
            notes.append(f"weights replayed to step {step} miss its old log-probs by {miss:.1e}: checks stop")
            break
        reference = initial if args["kl_coef"] > 0 or args["target_kl"] is not None else None
        check_logprobs(report, adapter, ref, step, policy, batch, d["old_logp"], "old_logp", reference, args)
        micro = ppo_micro_batch(d)
        if "minibatches" not in d or micro is None:
            report.skip("gradient", "the dump has no minibatches (made by an older version): nothing to replay")
            break
        order = d["minibatches"].view(-1, len(d["minibatch_index"]))
        for u, minibatch in enumerate(order):
            if u == len(order) - 1:  # the dumped micro-batch: the models have moved by u updates
                miss = replayed_miss(ref, policy, micro, d["new_logp"], args)
                if miss > tol:
                    notes.append(f"the replay of step {step}'s updates misses its new log-probs by {miss:.1e}")
                    return
                check_logprobs(report, adapter, ref, step, policy, micro, d["new_logp"], "new_logp", None, args)
                check_gradient(report, adapter, ref, step, micro, args, [m for m in (policy, critic) if m is not None])
            replay_ppo_update(ref, opt, policy, critic, batch, minibatch, args)
        scheduler.step()


def check_update(report, adapter, ref, steps, args, initial):
    """GRPO: the adapter's optimizer, its state kept, from the initial weights through the steps."""
    if args["script"] == "ppo":
        return report.skip("update", "PPO: its updates are replayed by this project's optimizer (gradient row)")
    if not hasattr(adapter, "update"):
        return report.skip("update", "adapter has no update()")
    model, state, key = copy.deepcopy(initial), {}, "old_logp" if args["num_iterations"] > 1 else "new_logp"
    for step in sorted(steps):
        if step + 1 not in steps:
            break
        _, why = call(adapter, "update", model, whole_batch(steps[step], args), args, state)
        if why:
            return report.skip("update", why)
        following = whole_batch(steps[step + 1], args)
        with torch.no_grad():
            after = ref.token_logprobs(copy.deepcopy(model).eval(), following, args)
        report.add("update", step, after, following[key], following["completion_mask"], key)
        report.exercise("update", "a step after the first (the optimizer's state carried over)", step > 1)
        report.exercise("update", "weight decay", args["weight_decay"] > 0)
    report.skip("update", "needs two consecutive steps")
