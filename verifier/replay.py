"""verify.py's checks that need the weights: the run replayed from --model with this project's loss and AdamW
(every GRPO iteration, every PPO minibatch). The replay row compares each replayed model with what the dump stored
(the policy's log-probs, the critic's values) before the adapter's log-probs, gradient and optimizer are compared on
it; a replay that stops matching fails that row at its step, and the rows after it say where they stopped.
"""

import copy

import torch

from common import select_rows
from verifier.calls import AdapterError, call, compare
from verifier.dump import inputs, micro_batch, whole_batch
from verifier.report import EARLY, loss_conditions, one_line

WEIGHT_ROWS = ("replay", "log-probs", "gradient", "update")


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


def check_logprobs(report, adapter, step, model, batch, expected, what, args, initial=None):
    """The adapter's log-probs from `model` against the stored ones (and from the reference, `initial`)."""
    mask, given = batch["completion_mask"], inputs("token_logprobs", batch, args)
    with torch.no_grad():
        theirs, why = call(adapter, "token_logprobs", copy.deepcopy(model).eval(), given, args)
        compare(report, "log-probs", step, adapter, "token_logprobs", theirs, expected, mask, what)
        if theirs is not None and initial is not None and "ref_logp" in batch:
            reference, _ = call(adapter, "token_logprobs", copy.deepcopy(initial).eval(), given, args)
            compare(
                report, "log-probs", step, adapter, "token_logprobs", reference, batch["ref_logp"], mask, "ref_logp"
            )
    report.skip("log-probs", why)
    report.exercise("log-probs", "left padding (prompts of different lengths)", (batch["prompt_mask"] == 0).any())
    report.exercise("log-probs", EARLY, (mask[:, -1] == 0).any())
    report.exercise("log-probs", "a temperature other than 1", args["temperature"] != 1)


def check_gradient(report, adapter, ref, step, batch, args, models):
    given = inputs("train_loss", batch, args)
    ours = gradients(lambda: ref.train_loss(models[0], given, args, *models[1:]), models)
    if args["script"] == "grpo":
        report.exercise("update", "the gradient's norm clipped", ours.norm() > args["max_grad_norm"])
    theirs, why = adapter_gradients(adapter, [copy.deepcopy(m) for m in models], given, args)
    if theirs is not None:
        report.add("gradient", step, theirs, ours)
        loss_conditions(report, ["gradient"], ref, inputs("loss", batch, args), args)
    report.skip("gradient", why)


def replayed(report, ref, step, models, batch, stored, args):
    """The replay row at `step`: the replayed policy's log-probs and critic's values against the stored `stored`
    (log-probs' key, values' key or None). Whether they match (within the replay's tolerance)."""
    mask, (policy, critic) = batch["completion_mask"], models
    with torch.no_grad():
        logp = ref.token_logprobs(policy.eval(), batch, args)
        report.add("replay", step, logp, batch[stored[0]], mask, f"the policy's {stored[0]}")
        if critic is not None and stored[1]:
            values = ref.token_values(critic.eval(), batch, args)
            report.add("replay", step, values, batch[stored[1]], mask, f"the critic's {stored[1]}")
    report.exercise("replay", "a step after the first (weights the dump's updates moved)", step > 1)
    tolerance = report.limit("replay", *report.tolerances["replay"])
    return report.rows["replay"]["steps"][step]["diff"] <= tolerance


def stopped(report, step, why):
    """The replay cannot go on from `step`: each weight row says so beside what it compared before."""
    for q in WEIGHT_ROWS:
        report.unchecked(q, f"not checked from step {step}: {why}")
    return step


def replay_grpo(ref, policy, opt, batch, args, iterations):
    """`iterations` of grpo.py's optimizer steps on this step's batch, micro-batch by micro-batch."""
    N, size = len(batch["completion_mask"]), args["micro_batch_size"]
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


MISMATCH = "the replay stopped matching the dump (see the replay row)"


def check_grpo_weights(report, adapter, ref, steps, args, initial):
    """Every step replayed; returns the step the replay could not reach (None: it reached every one)."""
    policy, mu = copy.deepcopy(initial), args["num_iterations"]
    opt, scheduler = ref.optimizer(policy, args)
    for step in sorted(steps):
        if step > 1 and step - 1 not in steps:
            return stopped(
                report, step, f"step {step - 1} is not in the dump, so the weights cannot be replayed past it"
            )
        d = steps[step]
        batch = inputs("train_loss", whole_batch(d, args), args)
        if not replayed(report, ref, step, (policy, None), whole_batch(d, args), ("old_logp", None), args):
            return stopped(report, step, MISMATCH)
        replay_grpo(ref, policy, opt, batch, args, mu - 1)  # the dump holds the last iteration
        if mu > 1 and not replayed(report, ref, step, (policy, None), whole_batch(d, args), ("new_logp", None), args):
            return stopped(report, step, MISMATCH)
        check_logprobs(report, adapter, step, policy, whole_batch(d, args), d["new_logp"], "new_logp", args, initial)
        check_gradient(report, adapter, ref, step, whole_batch(d, args), args, [policy])
        replay_grpo(ref, policy, opt, batch, args, 1)
        scheduler.step()
    return None


def check_ppo_weights(report, adapter, ref, steps, args, initial, critic):
    """Every step and minibatch replayed; returns the step the replay could not reach (None: every one)."""
    policy, critic = copy.deepcopy(initial), copy.deepcopy(critic)
    opt, scheduler = ref.optimizer(policy, args, critic)
    reference = initial if args["kl_coef"] > 0 or args["target_kl"] is not None else None
    for step in sorted(steps):
        if step > 1 and step - 1 not in steps:
            return stopped(
                report, step, f"step {step - 1} is not in the dump, so the weights cannot be replayed past it"
            )
        d, batch = steps[step], whole_batch(steps[step], args)
        if not replayed(report, ref, step, (policy, critic), batch, ("old_logp", "values"), args):
            return stopped(report, step, MISMATCH)
        check_logprobs(report, adapter, step, policy, batch, d["old_logp"], "old_logp", args, reference)
        micro = micro_batch(d)
        if micro is None:
            why = "the dump has no minibatches (made by an older version): nothing to replay"
            return stopped(report, step, why)
        order = d["minibatches"].view(-1, len(d["minibatch_index"]))
        for u, minibatch in enumerate(order):
            if u == len(order) - 1:  # the dumped micro-batch: the models have moved by u updates
                if not replayed(report, ref, step, (policy, critic), micro, ("new_logp", "new_values"), args):
                    return stopped(report, step, MISMATCH)
                check_logprobs(report, adapter, step, policy, micro, d["new_logp"], "new_logp", args)
                check_gradient(report, adapter, ref, step, micro, args, [m for m in (policy, critic) if m is not None])
            replay_ppo_update(ref, opt, policy, critic, inputs("train_loss", batch, args), minibatch, args)
        scheduler.step()
    return None


def check_update(report, adapter, ref, steps, args, initial, reached):
    """GRPO: the adapter's optimizer, its state kept, from the initial weights through the steps the replay
    reached (`reached`: the first it did not, or None)."""
    if args["script"] == "ppo":
        return report.skip("update", "PPO: its updates are replayed by this project's optimizer (gradient row)")
    if not hasattr(adapter, "update"):
        return report.skip("update", "adapter has no update()")
    model, state = copy.deepcopy(initial), {}
    for step in sorted(steps):
        if step + 1 not in steps or (reached is not None and step + 1 >= reached):
            break
        _, why = call(adapter, "update", model, inputs("update", whole_batch(steps[step], args), args), args, state)
        if why:
            return report.skip("update", why)
        following = whole_batch(steps[step + 1], args)
        with torch.no_grad():
            after = ref.token_logprobs(copy.deepcopy(model).eval(), following, args)
        report.add("update", step, after, following["old_logp"], following["completion_mask"], "old_logp")
        report.exercise("update", "a step after the first (the optimizer's state carried over)", step > 1)
        report.exercise("update", "weight decay", args["weight_decay"] > 0)
    report.skip("update", "needs two consecutive steps")
