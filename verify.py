"""Verify another implementation against this one, from a dump, in one command.

    python grpo.py --task copy:1-3 --num-steps 3 --num-iterations 2 --learning-rate 1e-2 --clip-low 0.05 \\
        --clip-high 0.05 --beta 0.1 --max-new-tokens 4 --temperature 0.8 --weight-decay 0.1 \\
        --dump-dir dumps/grpo                                                     # the recommended GRPO dump
    python ppo.py --task copy:1-3 --num-steps 3 --prompts-per-step 16 --learning-rate 1e-2 \\
        --critic-learning-rate 1e-2 --clip-low 0.05 --clip-high 0.05 --cliprange-value 0.01 --target-kl 2 \\
        --kl-horizon 100 --max-new-tokens 4 --temperature 0.8 --gamma 0.95 --micro-batch-size 4 \\
        --dump-dir dumps/ppo                                                      # the recommended PPO dump
    python verify.py dumps/grpo --against self                 # this project against its own dump: passes
    python verify.py dumps/grpo --against trl                  # TRL's GRPOTrainer (requirements/extra.txt)
    python verify.py dumps/ppo --against openrlhf              # OpenRLHF (requirements/openrlhf.txt)
    python verify.py dumps/ppo --against my_adapter.py         # your code, through an adapter you write

Make the dump with your implementation's settings (its advantage eps is --adv-eps; its KL form, loss
aggregation and clip ranges are flags too). The recommended dumps exercise every branch a row checks: prompts
of different lengths (left padding), completions that end early and some without EOS, ratios away from 1
(GRPO: --num-iterations 2; PPO dumps its last update's first micro-batch), tokens clipped on both sides, values
moved and clipped, a KL that is not 0 (steps 2 and 3), a moving KL coefficient, a temperature and a gamma
other than 1, micro-batches smaller than their minibatch, weight decay and a clipped gradient norm. A row whose
branch no step exercised says so ("never exercised: ..."), in place of a plain pass.

Each quantity of each step is recomputed by the other implementation and compared on the real (unmasked)
positions; the table has one row per quantity (the largest difference over the steps), its tolerance, and the
result. A NaN or inf fails its row.

  advantages      GRPO: from the stored rewards; PPO: GAE from the stored rewards and values, whitened
  rewards         PPO: the per-token reward from token_scores, log-probs, kl_coef, the mask and the EOS penalty
  returns         PPO: GAE's returns
  kl_coef         PPO: each step's coefficient from the previous step's, by the adaptive controller
  log-probs       per-token log-probs of the policy and of the reference, from the weights the step used
  kl              the KL term (GRPO) or penalty (PPO) to the reference, per token, from the stored log-probs
  per-token loss  from the stored log-probs, advantages (PPO: and values) of the dumped (micro-)batch
  loss            the aggregated loss
  gradient        of the loss, from the replayed weights and the same batch (the strongest check)
  update          GRPO: the adapter's own optimizer stepped from the initial weights through every step, its
                  state carried over (AdamW, weight decay, the gradient's norm clipped), scored by the next
                  step's stored log-probs (a warmup schedule is checked where the dump has --warmup-steps)

Weights: step 1 starts from --model; later weights (and PPO's moved models within a step) are replayed here
from the stored batches with this project's loss and AdamW, each replay checked against the stored log-probs.

Exit status: 0 every check that ran passed (or differs by a known difference passed to --accept); 1 a check
failed; 2 bad input (the dump, its model, a flag); 3 a mistake in the adapter (it raises, exits, does not
compile, returns None, a non-tensor or the wrong shape, a train_loss without autograd); 130 interrupted.

An adapter is a Python file that defines some of these functions (a check whose function is missing, or
raises NotImplementedError(reason), is skipped). `batch` holds the dump's tensors (docs/verify.md, "Verify your
implementation"), plus num_seqs and num_tokens, the loss's denominators; `args` is the run's Args as a dict,
plus "script" ("grpo" or "ppo"). See verifier/adapters/self.py for this project's own.

  group_advantages(batch, args) -> [N] or [N, T]     gae(batch, args) -> (advantages, returns), [N, T] each
  rewards(batch, args) -> [N, T] (PPO)                kl_coef(batch, args) -> the next step's coefficient (PPO)
  token_logprobs(model, batch, args) -> [N, T]       kl(batch, args) -> [N, T]
  per_token_loss(batch, args) -> [N, T]              loss(batch, args) -> scalar
  train_loss(model, batch, args, critic=None) -> scalar tensor with autograd, whose gradient is compared
  update(model, batch, args, state): one training step in place; `state`, a dict, is kept from step to step
  OPTIONS = {name: default}, changed by --set name=value; setup(args, options, model), called once with a
  copy of the initial policy; differences(args, options) -> lines printed under the table;
  known_differences(args, options) -> {quantity: what differs and its source}: `--accept QUANTITY` shows that
  row as "differs (known: ...)" and does not fail on it (only that quantity; never shown as a pass).
"""

import argparse
import copy
import sys

import torch

from verifier.replay import check_grpo_weights, check_ppo_weights, check_update
from verifier.report import (  # noqa: F401
    EARLY,
    QUANTITIES,
    TOLERANCES,
    AdapterError,
    Interrupted,
    Report,
    VerifyError,
    as_tensor,
    call,
    compare,
    load_adapter,
    load_dump,
    loss_conditions,
    one_line,
    parse_options,
    parse_tolerances,
    ppo_micro_batch,
    whole_batch,
)


def check_advantages(report, adapter, step, d, batch, args):
    mask = d["completion_mask"]
    if args["script"] == "grpo":
        adv, why = call(adapter, "group_advantages", batch, args)
        expected = d.get("advantages")
        if adv is not None and expected is not None:
            adv = as_tensor(adapter, "group_advantages", adv)
            adv = adv[:, 0] if adv.shape == (len(mask), 1) else adv
            if adv.shape == mask.shape:  # one advantage per token: compared on the real tokens
                adv, expected = adv, expected[:, None].expand_as(mask)
        compare(
            report,
            "advantages",
            step,
            adapter,
            "group_advantages",
            adv,
            expected,
            mask if expected is not None and expected.dim() == 2 else None,
            "advantages",
        )
        report.skip("advantages", why)
        group_std = d["rewards"].view(-1, args["group_size"]).std(1)
        report.exercise("advantages", "a group whose rewards differ", (group_std > 0).any())
        return
    out, why = call(adapter, "gae", batch, args)
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise AdapterError(f"adapter {adapter.label!r}: gae() returned {type(out).__name__}, not (advantages, returns)")
    compare(report, "advantages", step, adapter, "gae", out and out[0], d.get("advantages"), mask, "advantages")
    compare(report, "returns", step, adapter, "gae", out and out[1], d.get("returns"), mask, "returns")
    for q in ("advantages", "returns"):
        report.skip(q, why)
        report.exercise(q, EARLY, (mask[:, -1] == 0).any())
        report.exercise(q, "gamma and lambda below 1", args["gamma"] < 1 and args["lam"] < 1)


def check_rewards(report, adapter, ref, step, d, batch, args):
    """PPO's per-token reward: from token_scores, the log-probs, kl_coef, the mask and the EOS penalty."""
    if "token_scores" not in d or "eos_ids" not in d:
        return report.skip("rewards", "the dump has no token_scores and eos_ids (made by an older version)")
    theirs, why = call(adapter, "rewards", batch, args)
    mask = d["completion_mask"]
    compare(report, "rewards", step, adapter, "rewards", theirs, d.get("rewards"), mask, "rewards")
    report.skip("rewards", why)
    has_eos = (torch.isin(d["completion_ids"], d["eos_ids"]) & mask.bool()).any(1)
    report.exercise("rewards", "a KL that is not 0", (ref.rewards_kl(batch, args) != 0).any() and d["kl_coef"] != 0)
    report.exercise(
        "rewards",
        "a completion without EOS, with --missing-eos-penalty > 0",
        (~has_eos).any() and args["missing_eos_penalty"] > 0,
    )
    report.exercise("rewards", "a completion with EOS", has_eos.any())
    report.exercise("rewards", EARLY, (mask[:, -1] == 0).any())


def check_pure(report, adapter, ref, step, d, args):
    """Everything computed from the stored tensors alone."""
    batch = whole_batch(d, args)
    check_advantages(report, adapter, step, d, batch, args)
    if args["script"] == "grpo":
        for q in ("rewards", "returns", "kl_coef"):
            report.skip(q, "GRPO has none")
        loss_batch = batch
    else:
        check_rewards(report, adapter, ref, step, d, batch, args)
        loss_batch = ppo_micro_batch(d)
        if loss_batch is None:
            for q in ("per-token loss", "loss", "gradient"):
                report.skip(q, "the dump has no micro_index and minibatch_index (a micro-batch's rows)")
            loss_batch = batch
    kl_batch = batch if args["script"] == "ppo" else loss_batch
    if args["script"] == "ppo" and args["kl_coef"] == 0 and args["target_kl"] is None:
        report.skip("kl", "no KL penalty (--kl-coef 0)")
    elif args["script"] == "grpo" and args["beta"] == 0:
        report.skip("kl", "no KL term (--beta 0)")
    else:
        theirs, why = call(adapter, "kl", kl_batch, args)
        ours, mask = torch.as_tensor(ref.kl(kl_batch, args)), kl_batch["completion_mask"].bool()
        compare(report, "kl", step, adapter, "kl", theirs, ours, mask, "kl")
        report.skip("kl", why)
        report.exercise("kl", "a KL that is not 0", (ours[mask] != 0).any())
    if "new_logp" not in loss_batch:
        return
    mask = loss_batch["completion_mask"]
    theirs, why = call(adapter, "per_token_loss", loss_batch, args)
    compare(
        report,
        "per-token loss",
        step,
        adapter,
        "per_token_loss",
        theirs,
        d.get("per_token_loss"),
        mask,
        "per_token_loss",
    )
    report.skip("per-token loss", why)
    theirs, why = call(adapter, "loss", loss_batch, args)
    compare(report, "loss", step, adapter, "loss", theirs, d.get("loss"), None, "loss")
    report.skip("loss", why)
    loss_conditions(report, ["per-token loss", "loss"], ref, loss_batch, args)


def check_kl_coef(report, adapter, ref, steps, args):
    """PPO: each step's stored kl_coef from the previous step's batch, by the adapter's controller."""
    if args["script"] != "ppo" or args["target_kl"] is None:
        return report.skip("kl_coef", "constant without --target-kl" if args["script"] == "ppo" else "GRPO has none")
    for step in sorted(steps):
        if step + 1 not in steps:
            continue
        batch = whole_batch(steps[step], args)
        theirs, why = call(adapter, "kl_coef", batch, args)
        compare(report, "kl_coef", step + 1, adapter, "kl_coef", theirs, steps[step + 1]["kl_coef"], None, "kl_coef")
        report.skip("kl_coef", why)
        error = ref.rewards_kl(batch, args).sum(1).mean().item() / args["target_kl"] - 1
        report.exercise("kl_coef", "a KL error within +-0.2 of the target (not clipped)", abs(error) < 0.2)
        report.exercise("kl_coef", "a KL error beyond +-0.2 (clipped)", abs(error) > 0.2)
    report.skip("kl_coef", "needs two consecutive steps")


def verify(args, steps, adapter, options, tolerances, models=None, accept=()):
    """Every check on every step the dump allows: (Report, notes)."""
    ref = load_adapter("self")
    initial, critic = models or ref.initial_models(args)
    known = call(adapter, "known_differences", args, options)[0] if hasattr(adapter, "known_differences") else {}
    for quantity in accept:
        if quantity not in QUANTITIES:
            raise VerifyError(f"--accept {quantity!r}: the quantities are {', '.join(QUANTITIES)}")
        if quantity not in known:
            declared = ", ".join(known) or "none"
            raise VerifyError(
                f"--accept {quantity}: adapter {adapter.label!r} declares no known difference for it "
                f"(it declares: {declared})"
            )
    if hasattr(adapter, "setup"):
        _, why = call(adapter, "setup", args, options, copy.deepcopy(initial))
        if why:
            raise VerifyError(f"adapter {adapter.label!r}: {why}")
    report, notes = Report(tolerances), []
    for quantity in accept:
        report.rows[quantity]["known"] = known[quantity]
    for step in sorted(steps):
        check_pure(report, adapter, ref, step, steps[step], args)
    check_kl_coef(report, adapter, ref, steps, args)
    if 1 not in steps or args.get("resume"):
        notes.append("the dump does not start at step 1 from --model: no weight checks (they need its weights)")
        return report, notes
    if not any(hasattr(adapter, f) for f in ("token_logprobs", "train_loss", "update")):
        for q, f in (("log-probs", "token_logprobs"), ("gradient", "train_loss"), ("update", "update")):
            report.skip(q, f"adapter has no {f}()")
        return report, notes
    tol = tolerances["log-probs"][1]
    if args["script"] == "grpo":
        check_grpo_weights(report, adapter, ref, steps, args, initial, tol, notes)
    else:
        check_ppo_weights(report, adapter, ref, steps, args, initial, critic, tol, notes)
    check_update(report, adapter, ref, steps, args, initial)
    return report, notes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump_dir", help="the --dump-dir of a grpo.py or ppo.py run")
    parser.add_argument("--against", default="self", help="adapter: self, trl, verl, openrlhf, or a .py file")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="an adapter option")
    parser.add_argument("--tol", action="append", default=[], metavar="QUANTITY=VALUE", help="a tolerance")
    parser.add_argument(
        "--accept",
        action="append",
        default=[],
        metavar="QUANTITY",
        help="accept the adapter's declared known difference in this quantity (shown, not passed)",
    )
    opts = parser.parse_args(argv)
    try:
        tolerances = parse_tolerances(opts.tol)
        args, steps, notes = load_dump(opts.dump_dir)
        ref = load_adapter("self")
        try:  # before the adapter is imported: what it stubs cannot break the models' loading
            models = ref.initial_models(args)
        except (Exception, SystemExit) as e:
            raise VerifyError(
                f"the dump's model {args['model']!r} cannot be loaded ({one_line(e)}): it must be "
                "where the run found it"
            ) from None
        adapter = load_adapter(opts.against)
        options = parse_options(adapter, opts.set)
        torch.manual_seed(0)
        report, more = verify(args, steps, adapter, options, tolerances, models, opts.accept)
        differences = call(adapter, "differences", args, options)[0] if hasattr(adapter, "differences") else []
    except VerifyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except (Interrupted, KeyboardInterrupt) as e:
        print(f"interrupted{' ' + str(e) if str(e) else ''}: no result", file=sys.stderr)
        return 130
    span = f"steps {min(steps)}-{max(steps)}"
    with_options = f" {options}" if options else ""
    print(f"{args['script']}.py dump {opts.dump_dir} ({span}) against {adapter.label}{with_options}")
    print(report.table())
    for note in notes + more:
        print(f"note: {note}")
    failures = report.failures()
    if differences:
        print("known differences for this run:" if failures else "known differences (within tolerance here):")
        print("\n".join(f"  - {line}" for line in differences))
    unexercised = [q for q in QUANTITIES if report.passed(q) and report.unexercised(q)]
    if failures:
        print(f"FAIL: {', '.join(failures)}")
    else:
        print(
            "all checks that ran passed"
            + (f"; never exercised by this dump: {', '.join(unexercised)} (see the table)" if unexercised else "")
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
