"""verify.py's table: one row per quantity, its tolerance, a known difference accepted within its declared bound,
what the dump could not exercise, and the summary line with the exit status.
"""

import math

import torch

QUANTITIES = [
    "advantages",
    "rewards",
    "returns",
    "kl_coef",
    "replay",
    "log-probs",
    "kl",
    "per-token loss",
    "loss",
    "gradient",
    "update",
]
# (kind, value): "abs" bounds max |ours - theirs| over the real tokens of every step; "rel" bounds it over the row's
# scale, the largest |ours| over every step (a row that is 0 everywhere: over 1), never element by element, so a
# value near 0 (the KL at step 1, a loss of 1e-9) does not blow it up. Whitened or normalised quantities
# (advantages), scale-free ones (gradient, kl_coef) and the KL (it grows with the policy's distance from the
# reference: float noise with it) are relative. Float32 on CPU. The replay (this project's own updates, replayed
# from --model, against the dump's stored log-probs and values) and the log-probs are float32 forward passes of
# the same weights: 1e-5. Adam's update moves an element whose gradient is near 0 by up to the learning rate either
# way in two right implementations: after two steps at lr 1e-2, TRL's log-probs are 1.2e-4 from ours; wrong Adam
# betas (0.99) give 1e-2, a reset optimizer 3: the update gets 1e-3.
TOLERANCES = {
    "advantages": ("rel", 1e-5),
    "rewards": ("abs", 1e-6),
    "returns": ("abs", 1e-6),
    "kl_coef": ("rel", 1e-6),
    "replay": ("abs", 1e-5),
    "log-probs": ("abs", 1e-5),
    "kl": ("rel", 1e-6),
    "per-token loss": ("abs", 1e-6),
    "loss": ("abs", 1e-6),
    "gradient": ("rel", 1e-5),
    "update": ("abs", 1e-3),
}
LOSS_ROWS = ("per-token loss", "loss", "gradient")  # a pass needs one of these and the advantages (MINIMUM)
MINIMUM = "a pass needs the advantages row and a loss row (per-token loss, loss or gradient) compared"
# verify.py's exit statuses (its docstring documents them).
PASSED, FAILED, BAD_INPUT, ADAPTER_MISTAKE, INCOMPLETE, INTERRUPTED = 0, 1, 2, 3, 4, 130
EARLY = "a completion that ends early"


class VerifyError(Exception):
    """Bad input (the dump, the flags): one line, exit status 2."""


class AdapterError(Exception):
    """A mistake in the adapter (raises, returns None or the wrong shape, exits, does not compile): exit status 3."""


class Interrupted(Exception):
    """Ctrl-C: exit status 130, saying where."""


def one_line(e):
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def number(x):
    """A difference as the table prints it: NaN and inf by name."""
    return "NaN" if math.isnan(x) else "inf" if math.isinf(x) else f"{x:.2e}"


def parse_tolerances(pairs):
    """--tol QUANTITY=VALUE pairs over TOLERANCES (the kind stays)."""
    tolerances = dict(TOLERANCES)
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in tolerances:
            raise VerifyError(f"--tol {pair!r}: the quantities are {', '.join(QUANTITIES)}")
        try:
            tol = float(value)
        except ValueError:
            tol = float("nan")
        if not math.isfinite(tol) or tol < 0:
            raise VerifyError(f"--tol {pair!r}: the tolerance must be a finite number >= 0, e.g. {key}=1e-4")
        tolerances[key] = (tolerances[key][0], tol)
    return tolerances


def describe_known(spec):
    kind, bound = spec["bound"]
    return f"{spec['why']} ({spec['where']}); bound {kind} {bound:.0e}"


class Report:
    """One row per quantity: the differences of every step checked, or why it was skipped; the conditions the
    dump could not exercise; a known difference accepted by --accept, with the bound it must stay within."""

    def __init__(self, tolerances):
        self.rows = {q: dict(steps={}, skip=None, conditions={}, known=None, unchecked=None) for q in QUANTITIES}
        self.tolerances = tolerances

    def skip(self, quantity, reason):
        if reason and not self.rows[quantity]["steps"] and self.rows[quantity]["skip"] is None:
            self.rows[quantity]["skip"] = reason

    def unchecked(self, quantity, reason):
        """Steps of a row that were compared no further (the replay stopped matching): said beside its result."""
        if self.rows[quantity]["steps"]:
            self.rows[quantity]["unchecked"] = self.rows[quantity]["unchecked"] or reason
        else:
            self.skip(quantity, reason)

    def exercise(self, quantity, condition, met):
        """Record whether this step meets `condition`, a branch the row claims to check."""
        conditions = self.rows[quantity]["conditions"]
        conditions[condition] = conditions.get(condition, False) or bool(met)

    def add(self, quantity, step, actual, expected, mask=None, what="", scale=None):
        """Compare `actual` (the adapter's, already a float tensor of the dump's shape) with `expected` on the
        positions `mask` keeps. `scale`: the size this step's values are measured against (default: the largest
        |expected|). A NaN or inf on either side fails the row; so does, under --accept, a sign flipped."""
        if expected is None:
            return self.skip(quantity, f"the dump has no {what}")
        expected = torch.as_tensor(expected).detach().float().cpu()
        if mask is not None:
            keep = torch.as_tensor(mask).bool()
            actual, expected = actual[keep], expected[keep]
        both = torch.cat([actual.flatten(), expected.flatten()])
        nonfinite = "NaN" if both.isnan().any() else "inf" if both.isinf().any() else None
        gap = (actual - expected).abs()
        if nonfinite:
            diff, flip = (math.nan if nonfinite == "NaN" else math.inf), 0.0
        else:
            diff = gap.max().item() if gap.numel() else 0.0
            flipped = gap[(actual * expected) < 0]  # opposite signs: never a known difference
            flip = flipped.max().item() if flipped.numel() else 0.0
        if scale is None:
            finite = expected[expected.isfinite()].abs()
            scale = finite.max().item() if finite.numel() else 0.0
        row = self.rows[quantity]
        old = row["steps"].get(step, dict(diff=0.0, scale=0.0, flip=0.0, nonfinite=None, what=what))
        worse = not diff <= old["diff"]  # a NaN is worse than anything
        row["steps"][step] = dict(
            diff=diff if worse else old["diff"],
            scale=max(old["scale"], float(scale)),
            flip=max(old["flip"], flip),
            nonfinite=old["nonfinite"] or nonfinite,
            what=what if worse else old["what"],
        )
        row["skip"] = None

    def accept(self, quantity, spec):
        self.rows[quantity]["known"] = spec

    def scale(self, quantity):
        """The row's scale: the largest one over its steps (1 where every value is 0)."""
        return max((s["scale"] for s in self.rows[quantity]["steps"].values()), default=0.0) or 1.0

    def limit(self, quantity, kind, value):
        """The largest absolute difference `kind value` allows on this row."""
        return value if kind == "abs" else value * self.scale(quantity)

    def largest(self, quantity):
        diffs = [s["diff"] for s in self.rows[quantity]["steps"].values()]
        return math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)

    def status(self, quantity):
        """pass, known (a difference accepted within its bound), fail, or skip (nothing compared)."""
        row = self.rows[quantity]
        if not row["steps"]:
            return "skip"
        limit = self.limit(quantity, *self.tolerances[quantity])
        largest = self.largest(quantity)
        if largest <= limit:
            return "pass"
        known = row["known"]
        nonfinite = any(s["nonfinite"] for s in row["steps"].values())
        flipped = any(s["flip"] > limit for s in row["steps"].values())
        if known and not nonfinite and not flipped and largest <= self.limit(quantity, *known["bound"]):
            return "known"
        return "fail"

    def passed(self, quantity):
        return {"pass": True, "known": False, "fail": False}.get(self.status(quantity))

    def unexercised(self, quantity):
        return [c for c, met in self.rows[quantity]["conditions"].items() if not met]

    def result(self, quantity):
        row, status = self.rows[quantity], self.status(quantity)
        if status == "skip":
            return f"skip: {row['skip'] or 'no check of it ran on this dump'}"
        limit = self.limit(quantity, *self.tolerances[quantity])
        steps = sorted(row["steps"].items())
        at = ",".join(str(s) for s, d in steps if not d["diff"] <= limit)
        whats = sorted({d["what"] for _, d in steps if not d["diff"] <= limit and d["what"]})
        named = whats and quantity in ("replay", "log-probs")
        where = f" at step {at}" + (f" ({', '.join(whats)})" if named else "")
        if status == "pass":
            missed = self.unexercised(quantity)
            text = "pass" + (f"; never exercised: {', '.join(missed)}" if missed else "")
        elif status == "known":
            text = f"differs (known: {describe_known(row['known'])}){where}"
        else:
            nonfinite = next((d["nonfinite"] for _, d in steps if d["nonfinite"]), None)
            why = f" ({nonfinite})" if nonfinite else ""
            if row["known"] and not nonfinite:
                kind, bound = row["known"]["bound"]
                flipped = any(d["flip"] > limit for _, d in steps)
                why = (
                    " (a sign flipped: not the known difference)"
                    if flipped
                    else f" (beyond the known {kind} {bound:.0e})"
                )
            text = f"FAIL{why}{where}"
        return text + (f"; {row['unchecked']}" if row["unchecked"] else "")

    def table(self):
        lines = ["| quantity | steps | max abs diff | max rel diff | tolerance | result |", "|---" * 6 + "|"]
        for q, row in self.rows.items():
            kind, tol = self.tolerances[q]
            cells = ["-", "-", "-"]
            if row["steps"]:
                largest = self.largest(q)
                cells = [",".join(map(str, sorted(row["steps"]))), number(largest), number(largest / self.scale(q))]
            lines.append(f"| {q} | {' | '.join(cells)} | {kind} {tol:.0e} | {self.result(q)} |")
        return "\n".join(lines)

    def failures(self):
        return [q for q in QUANTITIES if self.status(q) == "fail"]

    def summary(self):
        """(the last line, the exit status): FAIL, INCOMPLETE (too little compared: MINIMUM) or PASS."""
        status = {q: self.status(q) for q in QUANTITIES}
        failures = [q for q in QUANTITIES if status[q] == "fail"]
        if failures:
            return f"FAIL: {', '.join(failures)}", FAILED
        compared = [q for q in QUANTITIES if status[q] in ("pass", "known")]
        theirs = [q for q in compared if q != "replay"]  # the replay checks the dump: no value of the adapter
        if "advantages" not in compared or not set(compared) & set(LOSS_ROWS):
            missing = [q for q in ("advantages", *LOSS_ROWS) if q not in compared]
            why = "; ".join(f"{q}: {self.rows[q]['skip'] or 'not compared'}" for q in missing)
            done = ", ".join(theirs) or "nothing"
            return f"INCOMPLETE: compared {done} of the adapter's; {MINIMUM} (skipped: {why})", INCOMPLETE
        passed = [q for q in compared if status[q] == "pass"]
        accepted = [q for q in compared if status[q] == "known"]
        line = f"PASS: {len(passed)} rows within their tolerances ({', '.join(passed)})"
        if accepted:
            line += (
                f"; {len(accepted)} accepted as known differences, within their declared bounds and beyond the "
                f"tolerance: {', '.join(accepted)}"
            )
        unexercised = [q for q in passed if self.unexercised(q)]
        if unexercised:
            line += f"; never exercised by this dump: {', '.join(unexercised)} (see the table)"
        return line, PASSED


def loss_conditions(report, quantities, ref, batch, args):
    """What a loss row exercises on this batch, read from this project's own per-token terms: what the loss clipped
    is its own `clipped` term (and `value_clipped`), so a variant that clips otherwise is described as it is."""
    _, terms = ref._loss(batch, args)
    if "logratio" not in terms or "advantages" not in terms:  # a loss without a ratio: nothing to say
        return
    real = batch["completion_mask"].bool()
    ends_early = (real[:, -1] == 0).any()
    ratio = terms["logratio"].exp()[real]
    out = (ratio < 1 - args["clip_low"]) | (ratio > 1 + args["clip_high"])
    clipped = terms["clipped"][real] if "clipped" in terms else None  # the loss's own: a loss without a clip has none
    for q in quantities:
        report.exercise(q, "a ratio away from 1", ((ratio - 1).abs() > 1e-6).any())
        report.exercise(q, EARLY, ends_early)  # the aggregation's denominators differ
        if clipped is not None:
            report.exercise(q, "a token the loss clipped, its ratio below 1", (clipped & (ratio < 1)).any())
            report.exercise(q, "a token the loss clipped, its ratio above 1", (clipped & (ratio > 1)).any())
            report.exercise(q, "a ratio out of the clip range that the loss did not clip", (out & ~clipped).any())
        if "new_values" in terms and "old_values" in terms:
            moved = (terms["new_values"] - terms["old_values"])[real]
            report.exercise(q, "values moved from the rollout's", (moved != 0).any())
            if "value_clipped" in terms:
                report.exercise(q, "a value the loss clipped", terms["value_clipped"][real].any())
            report.exercise(q, "a micro-batch smaller than its minibatch", batch["num_seqs"] > len(real))
        elif "kl_ref" in terms:
            report.exercise(q, "a KL that is not 0", (terms["kl_ref"][real] != 0).any())
