"""Verify another implementation against this one, from a dump, in one command.

    python grpo.py --num-steps 3 --beta 0.1 --dump-dir dumps    # any flags: the dump records them
    python verify.py dumps --against self                      # this project against its own dump: passes
    python verify.py dumps --against trl                       # TRL's GRPOTrainer (requirements-extra.txt)
    python verify.py dumps --against trl --set use_bias_correction_kl=false
    python verify.py dumps --against my_adapter.py             # your code, through an adapter you write

Each quantity of each step is recomputed by the other implementation and compared; the table has one row
per quantity (the largest difference over the steps checked), its tolerance, and pass or fail. The exit
status is 0 only when every check that ran passed; a skipped check says why.

  advantages      GRPO: group statistics of the stored rewards; PPO: GAE advantages (whitened) and returns
  log-probs       per-token log-probs of the policy and of the reference, from the weights the step used
  kl              the KL term to the reference, per token, from the stored log-probs (against this project's)
  per-token loss  from the stored log-probs and advantages (PPO: and values)
  loss            the aggregated loss
  gradient        of the loss, from the same weights and batch, against this project's (the strongest check)
  update          one optimizer step from the initial weights, scored by step 2's stored log-probs

Weights: step 1 starts from --model. GRPO's later weights are replayed here from the stored batches with this
project's loss and AdamW, and each replay is checked against the stored log-probs before it is used. PPO's
later weights would need every minibatch's rows, which the dump keeps for the first micro-batch only.

An adapter is a Python file that defines some of these functions (a check whose function is missing, or
raises NotImplementedError(reason), is skipped). `batch` holds the dump's tensors (README, "Verify your
implementation"), plus num_seqs and num_tokens, the loss's denominators; `args` is the run's Args as a dict,
plus "script" ("grpo" or "ppo"). See adapters/self.py for this project's own.

  group_advantages(batch, args) -> [N] or [N, T]     gae(batch, args) -> (advantages, returns), [N, T] each
  token_logprobs(model, batch, args) -> [N, T]       kl(batch, args) -> [N, T]
  per_token_loss(batch, args) -> [N, T]              loss(batch, args) -> scalar
  train_loss(model, batch, args, critic=None) -> scalar tensor with autograd, whose gradient is compared
  update(model, batch, args): one optimizer step in place, from fresh optimizer state
  OPTIONS = {name: default}, changed by --set name=value; setup(args, options, model), called once with a
  copy of the initial policy; differences(args, options) -> the known differences (one line each) that the
  run's flags switch on, printed under the table.
"""

import argparse
import copy
import glob
import importlib.util
import json
import os
import sys

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.abspath(__file__))
QUANTITIES = ["advantages", "returns", "log-probs", "kl", "per-token loss", "loss", "gradient", "update"]
# (kind, value): "abs" bounds max |ours - theirs|, "rel" bounds it over max |ours|. Float32 on CPU; a dump made
# under bf16 autocast needs --tol log-probs=1e-2. Adam's first step is about lr * sign(gradient), so a gradient
# element near 0 may move either way in two right implementations: the update gets 1e-4.
TOLERANCES = {
    "advantages": ("abs", 1e-6), "returns": ("abs", 1e-6), "log-probs": ("abs", 1e-5), "kl": ("abs", 1e-6),
    "per-token loss": ("abs", 1e-6), "loss": ("abs", 1e-6), "gradient": ("rel", 1e-5), "update": ("abs", 1e-4),
}  # fmt: skip
FUNCTIONS = ["group_advantages", "gae", "token_logprobs", "kl", "per_token_loss", "loss", "train_loss",
             "update"]


class VerifyError(Exception):
    """Bad input (dump, adapter, flags): reported as one line, exit status 2."""


def load_adapter(name):
    """A shipped adapter (adapters/NAME.py) or a path to a .py file."""
    path = name if name.endswith(".py") or os.sep in name else os.path.join(ROOT, "adapters", f"{name}.py")
    if not os.path.isfile(path):
        shipped = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "adapters", "*.py")))
        raise VerifyError(f"no adapter {name!r}: pass one of {', '.join(shipped)} or the path of a .py file")
    label = os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(f"verify_adapter_{label}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise VerifyError(f"adapter {label!r} cannot be imported: {e}") from None
    if not any(callable(getattr(module, f, None)) for f in FUNCTIONS):
        raise VerifyError(f"adapter {label!r} ({path}) defines none of the functions {', '.join(FUNCTIONS)}")
    module.label = label
    return module


def parse_options(adapter, pairs):
    """--set name=value pairs, checked against the adapter's OPTIONS and typed like their defaults."""
    options = dict(getattr(adapter, "OPTIONS", {}))
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in options:
            known = f"(options: {', '.join(options) or 'none'})"
            raise VerifyError(f"--set {pair!r}: adapter {adapter.label!r} has no option {key!r} {known}")
        if isinstance(options[key], bool):
            if value.lower() not in ("true", "false"):
                raise VerifyError(f"--set {pair!r}: {key} takes true or false")
            options[key] = value.lower() == "true"
        else:
            options[key] = type(options[key])(value)
    return options


def load_dump(dump_dir):
    """(the run's Args as a dict, plus "script"; {step: tensors}), or one line saying why this is not a dump."""
    meta_path = os.path.join(dump_dir, "metadata.json")
    if not os.path.isfile(meta_path):
        raise VerifyError(f"{dump_dir!r} is not a dump folder (no metadata.json): pass a run's --dump-dir")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        args = dict(meta["args"], script=meta["script"])
    except (ValueError, KeyError, TypeError) as e:
        raise VerifyError(f"{meta_path} is not a dump's metadata ({type(e).__name__}: {e})") from None
    if args["script"] not in ("grpo", "ppo"):
        raise VerifyError(f"{meta_path} is from {args['script']!r}, not grpo or ppo")
    paths = sorted(glob.glob(os.path.join(dump_dir, "step*.safetensors")))
    if not paths:
        raise VerifyError(f"{dump_dir!r} has no stepNNNNNN.safetensors: the run stopped before its first step")
    steps = {}
    for path in paths:
        try:
            steps[int(os.path.basename(path)[4:-12])] = load_file(path)
        except Exception as e:  # a truncated or foreign file
            raise VerifyError(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    for step, d in steps.items():
        missing = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask"} - d.keys()
        if missing:
            raise VerifyError(f"step {step} lacks {', '.join(sorted(missing))}: not a dump of this project")
        shape = tuple(d["completion_mask"].shape)
        for key, value in d.items():
            if value.dim() == 2 and not key.startswith("prompt") and value.shape[1] != shape[1]:
                raise VerifyError(f"step {step}: {key} has shape {tuple(value.shape)}, completion_mask {shape}")
        if d["prompt_ids"].shape != d["prompt_mask"].shape or len(d["prompt_ids"]) != shape[0]:
            prompt = tuple(d["prompt_ids"].shape)
            raise VerifyError(f"step {step}: prompt_ids {prompt} do not fit {shape[0]} completions")
    return args, steps


class Report:
    """One row per quantity: the worst difference over the steps checked, or why it was skipped."""

    def __init__(self, tolerances):
        self.rows = {q: dict(steps={}, abs=0.0, rel=0.0, skip=None) for q in QUANTITIES}  # steps: {step: diffs}
        self.tolerances = tolerances

    def skip(self, quantity, reason):
        if reason and not self.rows[quantity]["steps"] and self.rows[quantity]["skip"] is None:
            self.rows[quantity]["skip"] = reason

    def add(self, quantity, step, actual, expected, mask=None, what=""):
        if actual is None:
            return
        if expected is None:
            return self.skip(quantity, f"the dump has no {what}")
        actual = torch.as_tensor(actual).detach().float().cpu()
        expected = torch.as_tensor(expected).detach().float().cpu()
        if actual.shape != expected.shape:
            theirs, ours = tuple(actual.shape), tuple(expected.shape)
            raise VerifyError(f"step {step}: the adapter's {quantity} are {theirs}, the dump's {what} {ours}")
        if mask is not None:
            actual, expected = actual * mask, expected * mask
        diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
        scale = expected.abs().max().item() if expected.numel() else 0.0
        row, diffs = self.rows[quantity], dict(abs=diff, rel=diff / max(scale, 1e-30))
        for kind, value in diffs.items():
            row[kind] = max(row[kind], value)
        row["steps"][step] = {k: max(v, row["steps"].get(step, {}).get(k, 0.0)) for k, v in diffs.items()}
        row["skip"] = None

    def passed(self, quantity):
        row, (kind, tol) = self.rows[quantity], self.tolerances[quantity]
        return row[kind] <= tol if row["steps"] else None

    def table(self):
        lines = ["| quantity | steps | max abs diff | max rel diff | tolerance | result |", "|---" * 6 + "|"]
        for q, row in self.rows.items():
            kind, tol = self.tolerances[q]
            if row["steps"]:
                steps, result = ",".join(map(str, sorted(row["steps"]))), "pass" if self.passed(q) else "FAIL"
                failing = [str(s) for s, diffs in sorted(row["steps"].items()) if diffs[kind] > tol]
                result += f" at step {','.join(failing)}" if failing else ""
                diffs = f"{row['abs']:.2e} | {row['rel']:.2e}"
                lines.append(f"| {q} | {steps} | {diffs} | {kind} {tol:.0e} | {result} |")
            elif row["skip"]:
                lines.append(f"| {q} | - | - | - | {kind} {tol:.0e} | skip: {row['skip']} |")
        return "\n".join(lines)

    def failures(self):
        return [q for q in self.rows if self.passed(q) is False]


def call(adapter, name, *args, **kwargs):
    """The adapter's function's result and None, or None and why not (no such function, NotImplementedError)."""
    fn = getattr(adapter, name, None)
    if fn is None:
        return None, f"adapter has no {name}()"
    try:
        return fn(*args, **kwargs), None
    except NotImplementedError as e:
        return None, str(e) or f"{name}() is not implemented for this run"


def whole_batch(d):
    mask = d["completion_mask"]
    return dict(d, num_seqs=len(mask), num_tokens=int(mask.sum()))


def ppo_micro_batch(d):
    """The dump's first micro-batch with the log-probs and values its loss used (divided by its minibatch's)."""
    idx = d["micro_index"] if "micro_index" in d else d.get("mb_index")  # named mb_index in older dumps
    if idx is None or "minibatch_index" not in d:
        return None
    batch = {k: v[idx] for k, v in d.items() if v.dim() > 0 and len(v) == len(d["completion_mask"])}
    minibatch = d["minibatch_index"]
    return dict(batch, new_logp=d["new_logp"], new_values=d["new_values"], entropy=d.get("entropy"),
                kl_coef=d["kl_coef"], num_seqs=len(minibatch), num_tokens=int(d["completion_mask"][minibatch].sum()))


def gradients(loss_fn, models):
    for model in models:
        model.zero_grad(set_to_none=True)
        model.train()
    loss_fn().backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for m in models for p in m.parameters()]
    return torch.cat([g.flatten() for g in grads])


def logprobs(adapter, model, batch, args):
    with torch.no_grad():
        return call(adapter, "token_logprobs", copy.deepcopy(model).eval(), batch, args)


def check_pure(report, adapter, ref, step, d, args):
    """Everything computed from the stored tensors alone."""
    mask, batch = d["completion_mask"].float(), whole_batch(d)
    if args["script"] == "grpo":
        adv, why = call(adapter, "group_advantages", batch, args)
        expected, per_token = d.get("advantages"), adv is not None and torch.as_tensor(adv).dim() == 2
        if per_token and expected is not None:  # one advantage per token: compared on the real tokens
            expected = expected[:, None] * mask
        report.add("advantages", step, adv, expected, mask if per_token else None, "advantages")
        report.skip("returns", "GRPO has no returns")
        loss_batch = batch
    else:
        out, why = call(adapter, "gae", batch, args)
        report.add("advantages", step, out and out[0], d.get("advantages"), mask, "advantages")
        report.add("returns", step, out and out[1], d.get("returns"), mask, "returns")
        report.skip("returns", why)
        loss_batch = ppo_micro_batch(d)
        if loss_batch is None:
            for q in ("per-token loss", "loss", "gradient"):
                report.skip(q, "the dump has no micro_index and minibatch_index (the first micro-batch's rows)")
            loss_batch = batch
    report.skip("advantages", why)
    kl_batch = batch if args["script"] == "ppo" else loss_batch
    if args["script"] == "ppo" or args["beta"] > 0:
        theirs, why = call(adapter, "kl", kl_batch, args)
        report.add("kl", step, theirs, ref.kl(kl_batch, args), kl_batch["completion_mask"].float(), "kl")
        report.skip("kl", why)
    report.skip("kl", "no KL term (--beta 0)")
    if "new_logp" not in loss_batch:
        return
    theirs, why = call(adapter, "per_token_loss", loss_batch, args)
    report.add("per-token loss", step, theirs, d.get("per_token_loss"), loss_batch["completion_mask"].float(),
               "per_token_loss")  # fmt: skip
    report.skip("per-token loss", why)
    theirs, why = call(adapter, "loss", loss_batch, args)
    report.add("loss", step, theirs, d.get("loss"), None, "loss")
    report.skip("loss", why)


def check_weights(report, adapter, ref, step, d, args, models, initial):
    """Checks on the step's weights: models = [policy] (PPO: [policy, critic]); initial = the reference."""
    mask, batch = d["completion_mask"].float(), whole_batch(d)
    theirs, why = logprobs(adapter, models[0], batch, args)
    key = "new_logp" if args["script"] == "grpo" else "old_logp"  # the log-probs of these weights
    report.add("log-probs", step, theirs, d.get(key), mask, key)
    if theirs is not None and "ref_logp" in d and (args["script"] == "grpo" or args["kl_coef"] > 0):
        reference, _ = logprobs(adapter, initial, batch, args)
        report.add("log-probs", step, reference, d["ref_logp"], mask, "ref_logp")
    report.skip("log-probs", why)
    loss_batch = batch if args["script"] == "grpo" else ppo_micro_batch(d)
    if getattr(adapter, "train_loss", None) is None or loss_batch is None:
        return report.skip("gradient", "adapter has no train_loss()")
    ours = gradients(lambda: ref.train_loss(models[0], loss_batch, args, *models[1:]), models)
    copies = [copy.deepcopy(m) for m in models]
    try:
        theirs = gradients(lambda: adapter.train_loss(copies[0], loss_batch, args, *copies[1:]), copies)
    except NotImplementedError as e:
        return report.skip("gradient", str(e))
    report.add("gradient", step, theirs, ours, None, "gradient")


def replay(ref, policy, opt, d, args, iterations):
    """`iterations` of grpo.py's optimizer steps on this step's batch, micro-batch by micro-batch."""
    batch, N, size = whole_batch(d), len(d["completion_mask"]), args["micro_batch_size"]
    policy.train()
    for _ in range(iterations):
        opt.zero_grad(set_to_none=True)
        for i in range(0, N, size):
            micro = {k: v[i : i + size] if torch.is_tensor(v) and v.dim() > 0 else v for k, v in batch.items()}
            ref.train_loss(policy, micro, args).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), args["max_grad_norm"])
        opt.step()


def verify(args, steps, adapter, options, tolerances):
    """Every check on every step the dump allows: (Report, notes)."""
    ref = load_adapter("self")
    initial, critic = ref.initial_models(args)
    try:
        if hasattr(adapter, "setup"):
            adapter.setup(args, options, copy.deepcopy(initial))
    except NotImplementedError as e:
        raise VerifyError(f"adapter {adapter.label!r}: {e}") from None
    report, notes = Report(tolerances), []
    for step in sorted(steps):
        check_pure(report, adapter, ref, step, steps[step], args)
    if 1 not in steps or args.get("resume"):
        notes.append("the dump does not start at step 1 from --model: no weight checks (they need its weights)")
        return report, notes
    policy = copy.deepcopy(initial)
    if args["script"] == "ppo":
        check_weights(report, adapter, ref, 1, steps[1], args, [policy, critic], initial)
        if len(steps) > 1:
            notes.append("PPO after step 1: no weight checks (the dump keeps one micro-batch's rows, not all)")
        report.skip("update", "PPO: not compared (several epochs over random minibatches)")
        return report, notes
    mu, (opt, scheduler) = args["num_iterations"], ref.optimizer(policy, args)
    for step in sorted(steps):
        d = steps[step]
        if step > 1:  # the replayed weights must give what the run stored, or the checks below mean nothing
            if step - 1 not in steps:
                break
            with torch.no_grad():
                ours = ref.token_logprobs(policy.eval(), whole_batch(d), args)
            diff = ((ours - d["old_logp" if mu > 1 else "new_logp"]) * d["completion_mask"]).abs().max().item()
            if diff > tolerances["log-probs"][1]:
                notes.append(f"weights replayed to step {step} miss its log-probs by {diff:.1e}: checks stop")
                break
        replay(ref, policy, opt, d, args, mu - 1)  # the dump holds the last iteration
        check_weights(report, adapter, ref, step, d, args, [policy], initial)
        if step == 1 and mu == 1 and 2 in steps and hasattr(adapter, "update"):
            theirs = copy.deepcopy(initial)
            adapter.update(theirs, whole_batch(d), args)
            with torch.no_grad():
                after = ref.token_logprobs(theirs.eval(), whole_batch(steps[2]), args)
            report.add("update", 1, after, steps[2]["new_logp"], steps[2]["completion_mask"].float(), "update")
        replay(ref, policy, opt, d, args, 1)
        scheduler.step()
    has_update = hasattr(adapter, "update")
    report.skip("update", "needs steps 1, 2 and --num-iterations 1" if has_update else "adapter has no update()")
    return report, notes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dump_dir", help="the --dump-dir of a grpo.py or ppo.py run")
    parser.add_argument("--against", default="self", help="adapter: self, trl, verl, or the path of a .py file")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="an adapter option")
    parser.add_argument("--tol", action="append", default=[], metavar="QUANTITY=VALUE", help="a tolerance")
    opts = parser.parse_args(argv)
    try:
        tolerances = dict(TOLERANCES)
        for pair in opts.tol:
            key, _, value = pair.partition("=")
            if key not in tolerances:
                raise VerifyError(f"--tol {pair!r}: the quantities are {', '.join(QUANTITIES)}")
            tolerances[key] = (tolerances[key][0], float(value))
        args, steps = load_dump(opts.dump_dir)
        adapter = load_adapter(opts.against)
        options = parse_options(adapter, opts.set)
        torch.manual_seed(0)
        report, notes = verify(args, steps, adapter, options, tolerances)
    except VerifyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps = f"steps {min(steps)}-{max(steps)}"
    with_options = f" {options}" if options else ""
    print(f"{args['script']}.py dump {opts.dump_dir} ({steps}) against {adapter.label}{with_options}")
    print(report.table())
    for note in notes:
        print(f"note: {note}")
    differences = adapter.differences(args, options) if hasattr(adapter, "differences") else []
    failures = report.failures()
    if differences:
        print("known differences for this run:" if failures else "known differences (within tolerance here):")
        print("\n".join(f"  - {line}" for line in differences))
    print(f"FAIL: {', '.join(failures)}" if failures else "all checks that ran passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
