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
    "critic gradient",
    "update",
    "critic update",
]
CRITIC_ROWS = ("critic gradient", "critic update")  # the critic apart: its difference never masks the policy's
# (kind, value): "abs" bounds max |ours - theirs| over the real tokens of every step; "rel" bounds it over the row's
# scale, the largest |ours| over every step (a row that is 0 everywhere: over 1), never element by element, so a
# value near 0 (the KL at step 1, a loss of 1e-9) does not blow it up. Whitened or normalised quantities
# (advantages), scale-free ones (gradient, kl_coef) and the KL (it grows with the policy's distance from the
# reference: float noise with it) are relative. Float32 on CPU. The replay (this project's own updates, replayed
# from --model, against the dump's stored log-probs and values) and the log-probs are float32 forward passes of
# the same weights: 1e-5. The update is measured against how far this project's update moved the next step's
# log-probs (PPO: and values). On the recommended dumps a right update summed in another order (micro-batches of 1
# or of the whole batch) is within 3e-6 of that movement (GRPO: 2 AdamW steps a step at lr 1e-3) and 6.5e-4 (PPO:
# 4 a step at lr 1e-2, where Adam moves an element whose gradient is near 0 by up to the learning rate either way;
# 1.8e-3 on a PPO dump without weight decay); Adam betas (0.9, 0.99) miss it by 1.3e-3 (GRPO) and 1.2 (PPO), Adam
# eps 1e-6 by 1.9e-3 and 3.1. GRPO's 2e-4 sits 70x above its rounding and 6x below its slips; PPO's 1e-2 (PPO_UPDATE)
# 15x above and 120x below (docs/verify.md, "How the update's tolerance was chosen").
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
    "critic gradient": ("rel", 1e-5),
    "update": ("rel", 2e-4),
    "critic update": ("rel", 2e-4),
}
PPO_UPDATE = ("rel", 1e-2)  # the update row of a PPO dump (above)
# A known difference's bound may not exceed the row's own size (rel 1): beyond it, the adapter computes another
# quantity, not the same one another way. The gradient's direction must stay within 60 degrees of ours (cosine 0.5).
CEILING, DIRECTION = 1.0, 0.5
LOOSEN = 10  # --tol may loosen a row's tolerance up to 10x its default (parse_tolerances)
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


def cosine(a, b):
    norms = a.norm() * b.norm()
    return (a.flatten() @ b.flatten() / norms).item() if norms > 0 else 1.0


def number(x):
    """A difference as the table prints it: NaN and inf by name."""
    return "NaN" if math.isnan(x) else "inf" if math.isinf(x) else f"{x:.2e}"


def default_tolerances(script="grpo"):
    """TOLERANCES, a PPO dump's update rows at PPO_UPDATE."""
    ppo = script == "ppo"
    return dict(TOLERANCES, **{q: PPO_UPDATE if ppo else TOLERANCES[q] for q in ("update", "critic update")})


def parse_tolerances(pairs, script="grpo"):
    """--tol QUANTITY=VALUE pairs over the defaults (the kind stays). Tightening is free; loosening goes up to
    LOOSEN times the default: beyond it a row no longer tells the slips it is there for from rounding (the update's
    6x to 120x, docs/verify.md), so it is refused."""
    tolerances = default_tolerances(script)
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
        kind, default = tolerances[key]
        if tol > LOOSEN * default:
            raise VerifyError(
                f"--tol {pair!r}: beyond the ceiling {kind} {LOOSEN * default:g} ({LOOSEN}x the default "
                f"{default:g}): a difference that large is a bug, not rounding; find its cause instead"
            )
        tolerances[key] = (kind, tol)
    return tolerances


def loosened(tolerances, script):
    """The tolerances loosened by --tol, as the PASS line names them."""
    default = default_tolerances(script)
    return [
        f"{q} {kind} {value(tol)} (default {value(default[q][1])})"
        for q, (kind, tol) in tolerances.items()
        if tol > default[q][1]
    ]


def value(x):
    """A tolerance or bound as printed: 1e-05 when that is all of it, else three digits (6.40e-02)."""
    return f"{x:.0e}" if float(f"{x:.0e}") == x else f"{x:.2e}"


def describe_known(spec):
    if "expect" in spec:
        return f"{spec['why']} ({spec['where']}); matches the declared expectation within the tolerance"
    kind, bound = spec["bound"]
    return f"{spec['why']} ({spec['where']}); bound {kind} {value(bound)}, derived: {spec['derivation']}"


def largest_gap(actual, expected):
    """max |actual - expected| (NaN where either has a NaN, inf an inf), 0 when empty."""
    gap = (actual - expected).abs()
    if gap.isnan().any():
        return math.nan
    return gap.max().item() if gap.numel() else 0.0


class Report:
    """One row per quantity: the differences of every step checked, or why it was skipped; the conditions the
    dump could not exercise; a known difference accepted by --accept, with the bound it must stay within."""

    def __init__(self, tolerances, script="grpo"):
        self.rows = {
            q: dict(steps={}, skip=None, conditions={}, known=None, unchecked=None, absent=False) for q in QUANTITIES
        }
        self.tolerances, self.script = tolerances, script
        self.declared, self.equal, self.written_out = set(), [], []  # known differences not --accept-ed; the rest:
        # the dump's equal pairs (settings.py) and what the adapter writes out of its peer, both said on a PASS

    def skip(self, quantity, reason):
        if reason and not self.rows[quantity]["steps"] and self.rows[quantity]["skip"] is None:
            self.rows[quantity]["skip"] = reason

    def absent(self, quantity, reason):
        """A row the script has none of (GRPO's rewards): skipped, and not named among what a PASS left out."""
        self.skip(quantity, reason)
        self.rows[quantity]["absent"] = True

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

    def add(self, quantity, step, actual, expected, mask=None, what="", scale=None, known=None):
        """Compare `actual` (the adapter's, already a float tensor of the dump's shape) with `expected` on the
        positions `mask` keeps. `scale`: the size this step's values are measured against (default: the largest
        |expected|). A NaN or inf on either side fails the row; so does, under --accept, a sign flipped (the gradient:
        a direction more than 60 degrees from ours). `known`: the accepted known difference's expectation, of
        `actual`'s shape: the row's difference from it is kept too."""
        if expected is None:
            return self.skip(quantity, f"the dump has no {what}")
        expected = torch.as_tensor(expected).detach().float().cpu()
        if mask is not None:
            keep = torch.as_tensor(mask).bool()
            actual, expected = actual[keep], expected[keep]
            known = None if known is None else known[keep]
        kdiff = None if known is None else largest_gap(actual, known.float())
        both = torch.cat([actual.flatten(), expected.flatten()])
        nonfinite = "NaN" if both.isnan().any() else "inf" if both.isinf().any() else None
        gap = (actual - expected).abs()
        if nonfinite:
            diff, flip = (math.nan if nonfinite == "NaN" else math.inf), 0.0
        else:
            diff = gap.max().item() if gap.numel() else 0.0
            flipped = gap[(actual * expected) < 0]  # opposite signs: never a known difference
            flip = flipped.max().item() if flipped.numel() else 0.0
            if quantity.endswith("gradient"):  # its elements may change sign; its direction may not
                flip = 0.0 if cosine(actual, expected) >= DIRECTION else math.inf
        if scale is None:
            finite = expected[expected.isfinite()].abs()
            scale = finite.max().item() if finite.numel() else 0.0
        row = self.rows[quantity]
        old = row["steps"].get(step, dict(diff=0.0, scale=0.0, flip=0.0, nonfinite=None, what=what, kdiff=None))
        worse = not diff <= old["diff"]  # a NaN is worse than anything
        if kdiff is not None and old["kdiff"] is not None:
            kdiff = kdiff if not kdiff <= old["kdiff"] else old["kdiff"]
        row["steps"][step] = dict(
            diff=diff if worse else old["diff"],
            kdiff=kdiff if kdiff is not None else old["kdiff"],
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

    def known_limit(self, quantity):
        """The largest absolute difference the accepted known difference allows: its bound, at most the row's own
        size (CEILING)."""
        return min(self.limit(quantity, *self.rows[quantity]["known"]["bound"]), CEILING * self.scale(quantity))

    def flipped(self, quantity):
        limit = self.limit(quantity, *self.tolerances[quantity])
        return any(s["flip"] > limit for s in self.rows[quantity]["steps"].values())

    def expected_miss(self, quantity):
        """The largest difference, over the steps that do not match this project, from the accepted known
        difference's expectation (inf where a step has none)."""
        limit = self.limit(quantity, *self.tolerances[quantity])
        kdiffs = [s["kdiff"] for s in self.rows[quantity]["steps"].values() if not s["diff"] <= limit]
        if any(k is None for k in kdiffs):
            return math.inf
        return math.nan if any(math.isnan(k) for k in kdiffs) else max(kdiffs, default=0.0)

    def status(self, quantity):
        """pass, known (a difference accepted: each step matches this project or, within the same tolerance, the
        declared expectation; or a bound's rules), fail, or skip (nothing compared)."""
        row = self.rows[quantity]
        if not row["steps"]:
            return "skip"
        limit = self.limit(quantity, *self.tolerances[quantity])
        largest = self.largest(quantity)
        if largest <= limit:
            return "pass"
        if row["known"] and "expect" in row["known"]:
            return "known" if self.expected_miss(quantity) <= limit else "fail"
        nonfinite = any(s["nonfinite"] for s in row["steps"].values())
        if row["known"] and not nonfinite and not self.flipped(quantity) and largest <= self.known_limit(quantity):
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
            if row["known"] and "expect" in row["known"]:
                why = (
                    f" (neither this project's value nor the declared known difference's: "
                    f"{number(self.expected_miss(quantity))} from its expectation)"
                )
            elif row["known"] and not nonfinite:
                kind, bound = row["known"]["bound"]
                capped = self.known_limit(quantity) < self.limit(quantity, kind, bound)
                if self.flipped(quantity):
                    why = " (a sign flipped: not the known difference)"
                    if quantity.endswith("gradient"):
                        why = " (its direction is more than 60 degrees from ours: not the known difference)"
                else:
                    allowed = number(self.known_limit(quantity))
                    cap = f", capped at the row's own size {allowed}" if capped else f": at most {allowed}"
                    why = f" (beyond the known {kind} {value(bound)}{cap}, against {number(self.largest(quantity))})"
            hint = ""
            if quantity in self.declared and not row["known"]:
                hint = f" (the adapter declares a known difference here: --accept {quantity})"
            text = f"FAIL{why}{where}{hint}"
        return text + (f"; {row['unchecked']}" if row["unchecked"] else "")

    def table(self):
        lines = ["| quantity | steps | max abs diff | max rel diff | tolerance | result |", "|---" * 6 + "|"]
        for q, row in self.rows.items():
            kind, tol = self.tolerances[q]
            cells = ["-", "-", "-"]
            if row["steps"]:
                largest = self.largest(q)
                cells = [",".join(map(str, sorted(row["steps"]))), number(largest), number(largest / self.scale(q))]
            lines.append(f"| {q} | {' | '.join(cells)} | {kind} {value(tol)} | {self.result(q)} |")
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
        passed = [q for q in theirs if status[q] == "pass"]
        accepted = [q for q in compared if status[q] == "known"]
        line = f"PASS: {len(passed)} of the adapter's rows within their tolerances ({', '.join(passed)})"
        if loosened(self.tolerances, self.script):
            line += f"; tolerances loosened by --tol: {', '.join(loosened(self.tolerances, self.script))}"
        if "replay" in compared:
            line += "; this project's replayed updates matched the dump"
        if accepted:
            line += (
                f"; {len(accepted)} accepted as known differences (the declared expectation within the tolerance, "
                f"or a derived bound), beyond the tolerance from this project: {', '.join(accepted)}"
            )
        skipped = [q for q in QUANTITIES if status[q] == "skip" and not self.rows[q]["absent"] and q != "replay"]
        if skipped:
            why = [f"{q} ({self.rows[q]['skip'] or 'no check of it ran on this dump'})" for q in skipped]
            line += f"; not compared: {'; '.join(why)}"
        missed = [f"{q} ({', '.join(self.unexercised(q))})" for q in compared if self.unexercised(q)]
        if missed or self.equal:
            line += f"; never exercised by this dump: {'; '.join(missed + self.equal)}"
        if self.written_out:
            line += f"; written out by the adapter, not compared: {'; '.join(self.written_out)}"
        return line, PASSED
