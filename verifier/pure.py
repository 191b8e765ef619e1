"""verify.py's checks of what is computed from the stored tensors alone: the advantages (and PPO's returns, per-token
rewards and KL coefficient), the KL, and the losses, the losses called once per micro-batch as the dump's loop
called compute_loss. Each row compares the adapter with this project and, under --accept, with the adapter's
declared known difference (its exact expectation).
"""

import torch

from common import select_rows
from verifier.calls import AdapterError, as_tensor, call, compare, expectation, expecting
from verifier.conditions import controller_conditions, loss_conditions
from verifier.dump import inputs, micro_batch, whole_batch
from verifier.report import EARLY


def check_advantages(report, adapter, step, d, batch, args):
    mask = d["completion_mask"]
    if args["script"] == "grpo":
        given = inputs("group_advantages", batch, args)
        adv, why = call(adapter, "group_advantages", given, args)
        expected, keep = d["advantages"], None
        if adv is not None:
            adv = as_tensor(adapter, "group_advantages", adv)
            adv = adv[:, 0] if adv.shape == (len(mask), 1) else adv
            if adv.shape == mask.shape:  # one advantage per token: compared on the real tokens
                expected, keep = expected[:, None].expand_as(mask), mask
        known = expectation(report, "advantages", adapter, given, args) if adv is not None else None
        if known is not None and torch.is_tensor(known) and known.shape == (len(mask), 1):
            known = known[:, 0]
        compare(report, "advantages", step, adapter, "group_advantages", adv, expected, keep, "advantages", None, known)
        report.skip("advantages", why)
        group_std = d["rewards"].view(-1, args["group_size"]).std(1)
        report.exercise("advantages", "a group whose rewards differ", (group_std > 0).any())
        report.exercise("advantages", "a group whose rewards are all equal", (group_std == 0).any())
        return
    given = inputs("gae", batch, args)
    out, why = call(adapter, "gae", given, args)
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise AdapterError(f"adapter {adapter.label!r}: gae() returned {type(out).__name__}, not (advantages, returns)")
    for i, q in enumerate(("advantages", "returns")):
        known = expectation(report, q, adapter, given, args) if out is not None else None
        compare(report, q, step, adapter, "gae", out and out[i], d[q], mask, q, None, known)
        report.skip(q, why)
        report.exercise(q, EARLY, (mask[:, -1] == 0).any())
        report.exercise(q, "gamma and lambda below 1", args["gamma"] < 1 and args["lam"] < 1)


def check_rewards(report, adapter, ref, step, d, batch, args):
    """PPO's per-token reward: from token_scores, the log-probs, kl_coef, the mask and the EOS penalty."""
    if "token_scores" not in d:
        return report.skip("rewards", "the dump has no token_scores and eos_ids (made by an older version)")
    given = inputs("rewards", batch, args)
    theirs, why = call(adapter, "rewards", given, args)
    mask = d["completion_mask"]
    known = expectation(report, "rewards", adapter, given, args) if theirs is not None else None
    compare(report, "rewards", step, adapter, "rewards", theirs, d["rewards"], mask, "rewards", None, known)
    report.skip("rewards", why)
    has_eos = (torch.isin(d["completion_ids"], d["eos_ids"]) & mask.bool()).any(1)
    kl = ref.rewards_kl(given, args)
    report.exercise("rewards", "a KL that is not 0", (kl != 0).any() and d["kl_coef"] != 0)
    report.exercise(
        "rewards",
        "a completion without EOS, with --missing-eos-penalty > 0",
        (~has_eos).any() and args["missing_eos_penalty"] > 0,
    )
    report.exercise("rewards", "a completion with EOS", has_eos.any())
    scored_early = (d["token_scores"] != 0).any(1) & (mask[:, -1] == 0)  # where the score sits is not the last column
    report.exercise("rewards", "a non-zero score on a completion that ends early", scored_early.any())
    report.exercise("rewards", EARLY, (mask[:, -1] == 0).any())


def loop_micro_batches(batch, args):
    """The micro-batches the dump's loop called compute_loss on (GRPO: the whole batch's rows in order, its
    denominators kept; PPO's dumped micro-batch is one already)."""
    if args["script"] == "ppo":
        return [batch]
    size, rows = args["micro_batch_size"], len(batch["completion_mask"])
    return [select_rows(batch, slice(i, i + size)) for i in range(0, rows, size)]


def per_micro(adapter, name, micros, args, fn=None):
    """The adapter's `name` (or the expectation `fn`) called once per micro-batch, as the loop calls the loss: the
    per-token losses stacked, the losses summed (each micro-batch's is its share of the step's). None and why
    where it is skipped."""
    outs = []
    for micro in micros:
        out, why = call(adapter, name, micro, args) if fn is None else (fn(micro, args), None)
        if out is None:
            return None, why
        out = as_tensor(adapter, name, out)
        shape = tuple(micro["completion_mask"].shape) if name == "per_token_loss" else ()
        if tuple(out.shape) != shape and not (name == "loss" and out.numel() == 1):
            raise AdapterError(
                f"adapter {adapter.label!r}: {name}() returned shape {tuple(out.shape)} for a micro-batch of "
                f"{len(micro['completion_mask'])} rows; expected {shape}"
            )
        outs.append(out.reshape(shape))
    return (torch.cat(outs) if name == "per_token_loss" else sum(outs)), None


def check_losses(report, adapter, ref, step, d, loss_batch, args):
    mask, given = loss_batch["completion_mask"], inputs("loss", loss_batch, args)
    micros = loop_micro_batches(given, args)
    expected, rows = d["per_token_loss"], {"per_token_loss": "per-token loss", "loss": "loss"}
    for name, q in rows.items():
        theirs, why = per_micro(adapter, name, micros, args)
        known = None
        if theirs is not None and expecting(report, q):
            fn = expecting(report, q)
            known = per_micro(adapter, name, micros, args, lambda b, a, fn=fn: expectation(report, q, adapter, b, a))[0]
        if name == "per_token_loss":
            compare(report, q, step, adapter, name, theirs, expected, mask, name, None, known)
        else:  # the loss is measured against the per-token losses it sums: near 0, a loss's own size says nothing
            scale = (expected * mask).abs().max().item()
            compare(report, q, step, adapter, name, theirs, d["loss"].reshape(()), None, name, scale, known)
        report.skip(q, why)
    loss_conditions(report, list(rows.values()), ref, given, args)


def check_pure(report, adapter, ref, step, d, args):
    """Everything computed from the stored tensors alone."""
    batch = whole_batch(d, args)
    check_advantages(report, adapter, step, d, batch, args)
    if args["script"] == "grpo":
        for q in ("rewards", "returns", "kl_coef"):
            report.absent(q, "GRPO has none")
        loss_batch = batch
    else:
        check_rewards(report, adapter, ref, step, d, batch, args)
        loss_batch = micro_batch(d)
        if loss_batch is None:
            for q in ("per-token loss", "loss", "gradient", "critic gradient"):
                report.skip(q, "the dump has no micro_index and minibatch_index (a micro-batch's rows)")
            loss_batch = batch
    if args["script"] == "ppo" and args["kl_coef"] == 0 and args["target_kl"] is None:
        report.skip("kl", "no KL penalty (--kl-coef 0)")
    elif args["script"] == "grpo" and args["beta"] == 0:
        report.skip("kl", "no KL term (--beta 0)")
    else:
        kl_batch = inputs("kl", batch if args["script"] == "ppo" else loss_batch, args)
        theirs, why = call(adapter, "kl", kl_batch, args)
        ours, mask = torch.as_tensor(ref.kl(kl_batch, args)), kl_batch["completion_mask"].bool()
        known = expectation(report, "kl", adapter, kl_batch, args) if theirs is not None else None
        compare(report, "kl", step, adapter, "kl", theirs, ours, mask, "kl", None, known)
        report.skip("kl", why)
        report.exercise("kl", "a KL that is not 0", (ours[mask] != 0).any())
    if "new_logp" in loss_batch:
        check_losses(report, adapter, ref, step, d, loss_batch, args)


def check_kl_coef(report, adapter, ref, steps, args):
    """PPO: each step's stored kl_coef from the previous step's batch, by the adapter's controller."""
    if args["script"] != "ppo" or args["target_kl"] is None:
        if args["script"] != "ppo":
            return report.absent("kl_coef", "GRPO has none")
        return report.skip("kl_coef", "constant without --target-kl")
    for step in sorted(steps):
        if step + 1 not in steps:
            continue
        batch = whole_batch(steps[step], args)
        given = inputs("kl_coef", batch, args)
        theirs, why = call(adapter, "kl_coef", given, args)
        expected = steps[step + 1]["kl_coef"].reshape(())
        known = expectation(report, "kl_coef", adapter, given, args) if theirs is not None else None
        compare(report, "kl_coef", step + 1, adapter, "kl_coef", theirs, expected, None, "kl_coef", None, known)
        report.skip("kl_coef", why)
        error = ref.rewards_kl(inputs("rewards", batch, args), args).sum(1).mean().item() / args["target_kl"] - 1
        controller_conditions(report, error)
    report.skip("kl_coef", "needs two consecutive steps")
