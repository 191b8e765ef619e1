"""verify.py's checks that need the weights: the run replayed from --model with this project's loss and AdamW
(every GRPO iteration, every PPO minibatch). The replay row compares each replayed model with what the dump stored
(the policy's log-probs, the critic's values) before the adapter's log-probs, gradient and optimizer are compared on
it; a replay that stops matching fails that row at its step, and the rows after it say where they stopped.
"""

import copy

import torch

from common import select_rows
from verifier.calls import AdapterError, call, compare, expecting
from verifier.conditions import loss_conditions
from verifier.dump import inputs, micro_batch, whole_batch
from verifier.report import EARLY, one_line

WEIGHT_ROWS = ("replay", "log-probs", "gradient", "critic gradient", "update", "critic update")


def counts(batch):
    """The loss's denominators of a whole batch: its sequences and real tokens."""
    return batch["num_seqs"], batch["num_tokens"]


def flat_gradients(models):
    """Each model's gradient, flattened: [policy's, critic's]."""
    return [
        torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in m.parameters()])
        for m in models
    ]


def accumulated(loss_fn, models, micros):
    """The gradient of loss_fn(micro) summed over the micro-batches, as the loop accumulates it."""
    for model in models:
        model.zero_grad(set_to_none=True)
        model.train()
    for micro in micros:
        loss_fn(micro).backward()
    return flat_gradients(models)


def adapter_gradients(adapter, models, micros, args):
    """The gradient of the adapter's train_loss, accumulated over the micro-batches, or None and why it was skipped."""
    for model in models:
        model.zero_grad(set_to_none=True)
        model.train()
    for micro in micros:
        out, why = call(adapter, "train_loss", models[0], micro, args, *models[1:])
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
    return flat_gradients(models), None


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


def micro_batches(batch, rows, size, num_seqs, num_tokens):
    """The loop's micro-batches of `rows` (an index tensor) of `batch`, each with the loss's denominators."""
    return [
        dict(select_rows(batch, rows[i : i + size]), num_seqs=num_seqs, num_tokens=num_tokens)
        for i in range(0, len(rows), size)
    ]


GRADIENT_ROWS, UPDATE_ROWS = ("gradient", "critic gradient"), ("update", "critic update")  # policy's, critic's


def check_gradient(report, adapter, ref, step, micros, args, models, dumped):
    """The adapter's train_loss called micro-batch by micro-batch and its gradients summed, as the loop does, against
    this project's, each model's apart (and, under --accept, against the known difference's expect called the same
    way); `dumped`: the batch the dump's stored outputs are of (what the branches are read from)."""
    micros = [inputs("train_loss", micro, args) for micro in micros]
    ours = accumulated(lambda micro: ref.train_loss(models[0], micro, args, *models[1:]), models, micros)
    for q, grad in zip(UPDATE_ROWS, ours):
        report.exercise(q, "the gradient's norm clipped", grad.norm() > args["max_grad_norm"])
    theirs, why = adapter_gradients(adapter, [copy.deepcopy(m) for m in models], micros, args)
    if theirs is not None:
        known = [None] * len(models)
        for i, q in enumerate(GRADIENT_ROWS[: len(models)]):
            fn = expecting(report, q)
            if fn is not None:
                stand_in = type("Expected", (), {"label": adapter.label, "train_loss": staticmethod(fn)})
                known[i] = adapter_gradients(stand_in, [copy.deepcopy(m) for m in models], micros, args)[0][i]
        for q, mine, yours, expected in zip(GRADIENT_ROWS, ours, theirs, known):
            report.add(q, step, yours, mine, known=expected)
            loss_conditions(report, [q], ref, inputs("loss", dumped, args), args)
        if args["script"] == "grpo":  # PPO's loss rows say it: "a micro-batch smaller than its minibatch"
            more = "more than one micro-batch (--micro-batch-size below the batch)"
            report.exercise("gradient", more, len(micros) > 1)
    for q in GRADIENT_ROWS[: len(models)]:
        report.skip(q, why)


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
        whole = whole_batch(d, args)
        micros = micro_batches(
            whole, torch.arange(len(whole["completion_mask"])), args["micro_batch_size"], *counts(whole)
        )
        check_gradient(report, adapter, ref, step, micros, args, [policy], whole)
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
                tokens = int(batch["completion_mask"][minibatch].sum())
                micros = micro_batches(batch, minibatch, args["micro_batch_size"], len(minibatch), tokens)
                models = [m for m in (policy, critic) if m is not None]
                check_gradient(report, adapter, ref, step, micros, args, models, micro)
            replay_ppo_update(ref, opt, policy, critic, inputs("train_loss", batch, args), minibatch, args)
        scheduler.step()
    return None


def scored(ref, models, batch, args):
    """What the update row reads of the models on `batch`: the policy's log-probs and (PPO) the critic's values."""
    with torch.no_grad():
        out = [ref.token_logprobs(copy.deepcopy(models[0]).eval(), batch, args)]
        if len(models) > 1:
            out.append(ref.token_values(copy.deepcopy(models[1]).eval(), batch, args))
    return out


def check_update(report, adapter, ref, steps, args, initial, critic, reached):
    """The adapter's update(): its own optimizer, its state kept, from the initial models through the steps the
    replay reached (`reached`: the first it did not, or None). Scored by the next step's stored log-probs (the
    update row) and, PPO, values (the critic update row), each relative to how far this project's update moved them
    from where the adapter's models started. Under --accept, the known difference's expect (a train_loss) stands in
    for this project's loss in this project's optimizer, and the adapter's models must land where those do."""
    if not hasattr(adapter, "update"):
        return [report.skip(q, "adapter has no update()") for q in UPDATE_ROWS]
    ppo = args["script"] == "ppo"
    models = [copy.deepcopy(initial)] + ([copy.deepcopy(critic)] if ppo and critic is not None else [])
    fn = expecting(report, "update") or expecting(report, "critic update")
    expected = [copy.deepcopy(m) for m in models] if fn else None
    state, expected_state = {}, {}
    for step in sorted(steps):
        if step + 1 not in steps or (reached is not None and step + 1 >= reached):
            break
        d, following = steps[step], whole_batch(steps[step + 1], args)
        if ppo and "minibatches" not in d:
            return [report.skip(q, "the dump has no minibatches (made by an older version)") for q in UPDATE_ROWS]
        before = scored(ref, models, following, args)
        batch = inputs("update", whole_batch(d, args), args)
        if ppo:  # the minibatches' rows in the order the run took them: [update_epochs * num_minibatches, size]
            batch["minibatches"] = d["minibatches"].view(-1, len(d["minibatch_index"]))
        extra = [models[1] if len(models) > 1 else None] if ppo else []  # update(model, batch, args, state, critic)
        _, why = call(adapter, "update", models[0], dict(batch), args, state, *extra)
        if why:
            return [report.skip(q, why) for q in UPDATE_ROWS]
        try:
            now = scored(ref, models, following, args)
        except Exception as e:
            raise AdapterError(
                f"adapter {adapter.label!r}: the models its update() left cannot compute log-probs or values "
                f"({type(e).__name__}: {one_line(e)})"
            ) from None
        known = [None] * len(models)
        if fn:
            critic_of = expected[1] if len(expected) > 1 else None
            ref.update(expected[0], dict(batch), args, expected_state, critic_of, loss=fn)
            known = scored(ref, expected, following, args)
        mask = following["completion_mask"].bool()
        stored = [following["old_logp"], following["values"]] if ppo else [following["old_logp"]]
        for q, after, start, target, exp, what in zip(UPDATE_ROWS, now, before, stored, known, ("old_logp", "values")):
            moved = (target - start)[mask].abs().max().item()
            if moved == 0:  # nothing moved (a learning rate of 0): the difference itself
                moved = 1.0
            exp = exp / moved if exp is not None and expecting(report, q) else None
            report.add(q, step, after / moved, target / moved, mask, what, scale=1.0, known=exp)
            report.exercise(q, "a step after the first (the optimizer's state carried over)", step > 1)
            report.exercise(q, "weight decay", args["weight_decay"] > 0)
            micro = args["micro_batch_size"] < (len(mask) if not ppo else len(batch["minibatches"][0]))
            report.exercise(q, "more than one micro-batch an optimizer step", micro)
            per_step = len(batch["minibatches"]) if ppo else args["num_iterations"]
            report.exercise(q, "more than one optimizer step a training step", per_step > 1)
            report.exercise(q, "a learning rate that moves (--warmup-steps)", args["warmup_steps"] > 0)
    for q in UPDATE_ROWS:
        report.skip(q, "needs two consecutive steps")
