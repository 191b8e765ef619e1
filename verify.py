"""Verify another implementation against this one, from a dump, in one command.

    python grpo.py --model tiny-gpt2 --task copy:1-3 --num-steps 3 --num-iterations 2 --learning-rate 1e-3 \\
        --warmup-steps 2 --clip-low 0.05 --clip-high 0.08 --beta 0.1 --max-new-tokens 4 --temperature 0.8 \\
        --weight-decay 1 --micro-batch-size 32 --dump-dir dumps/grpo              # the recommended GRPO dump
    python ppo.py --model tiny-gpt2 --task copy:1-3 --num-steps 4 --prompts-per-step 16 \\
        --learning-rate 1e-2 --critic-learning-rate 3e-3 --warmup-steps 2 --clip-low 0.05 --clip-high 0.08 \\
        --cliprange-value 0.01 --target-kl 1.0 --kl-horizon 100 --max-new-tokens 4 --temperature 0.8 --gamma 0.95 \\
        --lam 0.9 --micro-batch-size 4 --ent-coef 0.01 --weight-decay 0.01 --max-grad-norm 0.3 --dump-dir dumps/ppo
    python verify.py dumps/grpo --against self                 # this project against its own dump: passes
    python verify.py dumps/grpo --against trl                  # TRL's GRPOTrainer (requirements/extra.txt)
    python verify.py dumps/ppo --against openrlhf              # OpenRLHF (requirements/openrlhf.txt)
    python verify.py dumps/ppo --against my_adapter.py         # your code, through an adapter you write

Make the dump with your implementation's settings (its advantage eps is --adv-eps; its KL form, loss
aggregation and clip ranges are flags too). The recommended dumps exercise every branch a row checks: prompts
of different lengths (left padding) on a model with absolute positions (tiny-gpt2: a position id that ignores
the padding changes its log-probs, where rotary positions hide it), completions that end early and some without
EOS, ratios away from 1 (GRPO: --num-iterations 2; PPO dumps its last update's first micro-batch), tokens clipped
on both sides, values moved and clipped, a KL that is not 0 (steps 2 and 3), a moving KL coefficient, a
temperature and a gamma other than 1, micro-batches smaller than their batch (GRPO) or minibatch (PPO), an entropy
bonus (PPO), several optimizer steps a step, weight decay and a clipped gradient norm. A row whose branch no step
exercised says so ("never exercised: ..."), and so does the PASS line, with every row it did not compare and every
pair of settings the dump keeps equal ("--clip-low equals --clip-high: swapped clip bounds would not show").

Each quantity of each step is recomputed by the other implementation and compared on the real (unmasked)
positions; the table has one row per quantity (the largest difference over the steps), its tolerance, and the
result. A NaN or inf fails its row. Every row appears: pass, FAIL, "differs (known: ...)", or skip with why.

  advantages      GRPO: from the stored rewards; PPO: GAE from the stored rewards and values, whitened
  rewards         PPO: the per-token reward from token_scores, log-probs, kl_coef, the mask and the EOS penalty
  returns         PPO: GAE's returns
  kl_coef         PPO: each step's coefficient from the previous step's, by the adaptive controller
  replay          this project's updates replayed from --model: the policy's log-probs and the critic's values
                  against the stored ones, at every step (a run that trained otherwise than its dump says fails)
  log-probs       per-token log-probs of the policy and of the reference, from the replayed weights
  kl              the KL term (GRPO) or penalty (PPO) to the reference, per token, from the stored log-probs
  per-token loss  from the stored log-probs, advantages (PPO: and values) of the dumped (micro-)batch
  loss            the aggregated loss
  gradient        of the loss, from the replayed weights: train_loss called micro-batch by micro-batch and the
                  gradients summed, as the loop accumulates them (GRPO: the whole batch; PPO: the dumped minibatch);
                  the policy's, and PPO's critic's in a row of its own (critic gradient), each against its own size
  update          the adapter's own optimizer stepped from the initial weights through every step, its state carried
                  over (AdamW, weight decay, the gradient's norm clipped; PPO: every minibatch, the critic too),
                  scored by the next step's stored log-probs (PPO: and values), relative to how far this
                  project's update moved them (a warmup schedule is checked where the dump has --warmup-steps);
                  the critic's values in a row of its own (critic update)

Exit status: 0 PASS: the advantages row and a loss row (per-token loss, loss or gradient) were compared, and every
row compared passed or differs by a known difference accepted within its bound; 1 FAIL: a row failed; 2 bad input
(the dump, its model, a flag); 3 a mistake in the adapter (it raises, exits, ends the process, does not compile,
returns None, a non-tensor, complex values or the wrong shape, a train_loss without autograd, a known
difference without a bound or beyond the ceiling); 4 INCOMPLETE: no row failed, but too little was compared for a
pass (the line says what was and why the rest was skipped);
130 interrupted. The checks run in a child process (verifier/isolation.py): an adapter that ends it is exit 3
(128 + N where a signal N killed it outside any adapter call: 137, out of memory).

An adapter is a Python file that defines some of these functions (a check whose function is missing, or
raises NotImplementedError(reason), is skipped). `args` is the run's Args as a dict, plus "script" ("grpo" or
"ppo"). `batch` holds the dump's tensors that the entry point it stands for reads in the training loop
(common.entry_batch): never what it is compared with (group_advantages and gae get no advantages or returns,
rewards no rewards, the losses no per_token_loss or loss); the loss functions also get num_seqs and num_tokens,
the loss's denominators, and per_token_loss, loss and kl the models' stored outputs (new_logp; PPO: new_values,
entropy); token_logprobs gets the ids and masks alone. See verifier/adapters/self.py for this project's own.

  group_advantages(batch, args) -> [N] or [N, T]     gae(batch, args) -> (advantages, returns), [N, T] each
  rewards(batch, args) -> [N, T] (PPO)                kl_coef(batch, args) -> the next step's coefficient (PPO)
  token_logprobs(model, batch, args) -> [N, T]       kl(batch, args) -> [N, T]
  per_token_loss(batch, args) -> [N, T]              loss(batch, args) -> scalar
  train_loss(model, batch, args, critic=None) -> scalar tensor with autograd, called micro-batch by micro-batch:
  its gradients, summed, are compared
  update(model, batch, args, state[, critic]): one training step in place (PPO: critic is the critic, or None,
  and batch["minibatches"] [optimizer steps, minibatch size] the rows of each optimizer step in the run's
  order); `state`, a dict, is kept from step to step
  OPTIONS = {name: default}, changed by --set name=value; setup(args, options, model), called once with a
  copy of the initial policy; differences(args, options) -> lines printed under the table;
  known_differences(args, options) -> {quantity: dict(why=..., where="the peer's file, function", expect=FN)}:
  FN computes from the dump what the peer gives by design (verifier/expect.py helps: ours(), with_args()), with the
  inputs of the row's function (gradient, update and their critic rows: a train_loss); `--accept QUANTITY` shows
  the row as "differs (known: ...)" where each step matches ours or FN's value WITHIN THE ROW'S OWN TOLERANCE, and
  fails it otherwise, so a bug on top of a known difference fails. Only where no exact form exists: bound=("rel",
  5e-2) with derivation="why it cannot be exceeded" (rel at most 1, an abs bound capped at the row's own size, every
  value finite, no sign flipped, the gradient's direction within 60 degrees). An accepted row is never a pass, and
  the PASS line counts it apart. WRITTEN_OUT = [lines]: pieces of the peer the adapter writes out itself, named on
  every PASS line ("written out by the adapter, not compared: ..."). --tol loosens a row up to 10x its default.
docs/verify.md lists each function's inputs and outputs, and what verify protects against and what it does not.
"""

import argparse
import copy
import os
import sys
import traceback

import torch

from verifier import isolation
from verifier.calls import call, known_differences, load_adapter, parse_options, written_out
from verifier.conditions import equal_pairs, loss_conditions  # noqa: F401  (verify.py has offered it)
from verifier.dump import load_dump
from verifier.pure import check_kl_coef, check_pure
from verifier.replay import WEIGHT_ROWS, check_grpo_weights, check_ppo_weights, check_update
from verifier.report import (  # noqa: F401  (the names verify.py has always offered)
    ADAPTER_MISTAKE,
    BAD_INPUT,
    CRITIC_ROWS,
    EARLY,
    INTERRUPTED,
    QUANTITIES,
    TOLERANCES,
    AdapterError,
    Interrupted,
    Report,
    VerifyError,
    one_line,
    parse_tolerances,
)


def check_weights(report, adapter, ref, steps, args, initial, critic, notes):
    """The replay from --model, and the log-probs, gradient and update rows on it (replay.py)."""
    if min(steps) != 1:
        why = f"the dump starts at step {min(steps)}: the weights are replayed from --model, which step 1 started from"
        return [report.skip(q, why) for q in WEIGHT_ROWS]
    if not any(hasattr(adapter, f) for f in ("token_logprobs", "train_loss", "update")):
        for q, f in (("log-probs", "token_logprobs"), ("gradient", "train_loss"), ("update", "update")):
            report.skip(q, f"adapter has no {f}()")
            if q != "log-probs":
                report.skip(f"critic {q}", f"adapter has no {f}()")
        return report.skip("replay", "the adapter has no token_logprobs, train_loss or update: no check needs it")
    if args["script"] == "grpo":
        reached = check_grpo_weights(report, adapter, ref, steps, args, initial)
    else:
        reached = check_ppo_weights(report, adapter, ref, steps, args, initial, critic)
    check_update(report, adapter, ref, steps, args, initial, critic, reached)
    if report.status("replay") == "fail" and args.get("resume"):
        notes.append(f"the run was resumed from {args['resume']}: a flag changed on --resume replays otherwise")


class Recomputing:
    """An error of this project's own code on a dump it has accepted: one line naming the step, exit status 2; one
    raised in the adapter's own file (past the calls' checks: an object it returned, a model it changed) is the
    adapter's mistake, exit status 3."""

    def __init__(self, where, adapter=None):
        self.where, self.adapter = where, adapter

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is None or issubclass(kind, (VerifyError, AdapterError, Interrupted, KeyboardInterrupt)):
            return False
        frames = traceback.extract_tb(trace)
        source = getattr(self.adapter, "__file__", None)
        if source and not getattr(self.adapter, "_verify_self", False):
            if any(os.path.abspath(f.filename) == os.path.abspath(source) for f in frames):
                raise AdapterError(
                    f"adapter {self.adapter.label!r}: its code raised {kind.__name__} while verify worked on "
                    f"{self.where} ({one_line(error)})"
                ) from None
        frame = frames[-1]  # where, should it be a mistake of verify's rather than the dump's
        raise VerifyError(
            f"this project cannot recompute {self.where} ({kind.__name__}: {one_line(error)}, in "
            f"{os.path.basename(frame.filename)}:{frame.lineno}): the dump is damaged or of another version; make "
            "it again"
        ) from None


def verify(args, steps, adapter, options, tolerances, models=None, accept=()):
    """Every check on every step the dump allows: (Report, notes)."""
    ref = load_adapter("self")
    initial, critic = models or ref.initial_models(args)
    known = known_differences(adapter, args, options)
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
    report, notes = Report(tolerances, args["script"]), []
    for quantity in accept:
        report.accept(quantity, known[quantity])
    report.declared = set(known) - set(accept)
    report.equal = equal_pairs(args)
    report.written_out = written_out(adapter, args, options)
    if args["script"] == "grpo" or critic is None:
        for q in CRITIC_ROWS:
            report.absent(q, "GRPO has no critic" if args["script"] == "grpo" else "no critic (--vf-coef 0)")
    for step in sorted(steps):
        with Recomputing(f"step {step}", adapter):
            check_pure(report, adapter, ref, step, steps[step], args)
    with Recomputing("the KL coefficients", adapter):
        check_kl_coef(report, adapter, ref, steps, args)
    with Recomputing("the weights (replaying the dump's updates)", adapter):
        check_weights(report, adapter, ref, steps, args, initial, critic, notes)
    return report, notes


def precision_note(args, meta, report):
    """Why the rows recomputed from the weights fail on a dump made under bfloat16 autocast."""
    failed = [q for q in WEIGHT_ROWS if report.status(q) == "fail"]
    dtype = meta.get("autocast_dtype") or (None if args["dtype"] == "auto" else args["dtype"])
    if not failed or dtype == "float32":
        return []
    made = (
        f"under {dtype} autocast"
        if dtype
        else "with --dtype auto by an older version, which does not record it: bfloat16 on a GPU or a CPU with "
        "native bfloat16"
    )
    return [
        f"the dump was made {made}: its stored log-probs and values carry bfloat16's rounding (about 1e-2) and "
        f"verify recomputes them in float32, so {', '.join(failed)} cannot pass at float32 tolerances: make the dump "
        "with --dtype float32"
    ]


def run(opts):
    """The whole verification (in the child process of main): its output, and its exit status."""
    try:
        args, steps, notes, meta = load_dump(opts.dump_dir)
        tolerances = parse_tolerances(opts.tol, args["script"])
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
        if not isinstance(differences, (list, tuple)) or not all(isinstance(line, str) for line in differences):
            raise AdapterError(f"adapter {adapter.label!r}: differences() must return a list of lines (str)")
    except VerifyError as e:
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return ADAPTER_MISTAKE
    except (Interrupted, KeyboardInterrupt) as e:
        print(f"interrupted{' ' + str(e) if str(e) else ''}: no result", file=sys.stderr)
        return INTERRUPTED
    span = f"steps {min(steps)}-{max(steps)}"
    with_options = f" {options}" if options else ""
    print(f"{args['script']}.py dump {opts.dump_dir} ({span}) against {adapter.label}{with_options}")
    print(report.table())
    for note in notes + more + precision_note(args, meta, report):
        print(f"note: {note}")
    if differences:
        print("known differences of this adapter for these flags (where a row passes, they did not show):")
        print("\n".join(f"  - {line}" for line in differences))
    line, status = report.summary()
    print(line)
    return status


def main(argv=None, fresh=False):
    """verify.py's command line; `fresh`: this process has run no torch yet (the script), so the child process
    the checks run in keeps torch's threads (isolation.py)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump_dir", help="the --dump-dir of a grpo.py or ppo.py run")
    parser.add_argument(
        "--against", default="self", help="adapter: self, trl, verl, openrlhf, skyrl, areal, or a .py file"
    )
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="an adapter option")
    parser.add_argument("--tol", action="append", default=[], metavar="QUANTITY=VALUE", help="a tolerance")
    parser.add_argument(
        "--accept",
        action="append",
        default=[],
        metavar="QUANTITY",
        help="accept the adapter's declared known difference in this quantity, within its declared bound",
    )
    opts = parser.parse_args(argv)
    return isolation.run(run, opts, threads=None if fresh else 1)


if __name__ == "__main__":
    sys.exit(main(fresh=True))
