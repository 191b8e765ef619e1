"""The agreement table: this project's recomputation by five other implementations (TRL, verl, OpenRLHF, SkyRL,
AReaL) on fresh dumps of each variant.

    python benchmarks/agreement.py                            # writes docs/agreement.md, about 9 minutes on CPU
    python benchmarks/agreement.py --verl-site .verl-site     # where verl is (requirements/verl.txt)
    python benchmarks/agreement.py --modes GSPO PPO           # only the variants whose name holds one of these

OpenRLHF, SkyRL and AReaL are found in .openrlhf-site, .skyrl-site and .areal-site (or $OPENRLHF_SITE, $SKYRL_SITE,
$AREAL_SITE); a peer that is not installed is a column of "absent". Each variant is verify.py's recommended dump
(tiny-gpt2, 3 steps, every branch exercised) with the variant's flags, recomputed by each peer through verify.py
with the peer's options aligned where it has one (TRL's KL form, verl's eps and Dr. GRPO constant) and every
difference the peer's adapter declares accepted within its bound. A cell is one row of verify.py's table: "agrees"
(within the row's tolerance, its largest difference in the row's kind), "differs" (its size, and the note that
names it), "not implemented" (the peer has no such computation, or the adapter cannot reach it: verify.py says
why) or "-" (the variant has no such quantity).
"""

import argparse
import contextlib
import io
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import grpo  # noqa: E402
import ppo  # noqa: E402
import verify  # noqa: E402
from verifier.report import describe_known  # noqa: E402


def recommended(script):
    """verify.py's recommended dump of `script` (its docstring's command line), as Args fields: every branch of
    every row exercised. Read from the docstring, so the table is always made from the dumps the docs recommend."""
    text = verify.__doc__.replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.strip().startswith(f"python {script}.py"))
    tokens = line.split("#")[0].split()[2:]
    fields = {tokens[i][2:].replace("-", "_"): tokens[i + 1] for i in range(0, len(tokens), 2)}
    fields.pop("dump_dir")
    for key, value in fields.items():
        for kind in (int, float):
            try:
                fields[key] = kind(value)
                break
            except ValueError:
                pass
    return fields


GRPO_RECIPE, PPO_RECIPE = recommended("grpo"), recommended("ppo")
PAPER = dict(GRPO_RECIPE, scale_rewards="group", bias_corrected_kl=False)
MODES = {
    "GRPO, verify.py's recommended dump (batch std, ratio-weighted k3, seq-mean-token-mean)": ("grpo", GRPO_RECIPE),
    "GRPO paper (group std, paper's k3, seq-mean-token-mean)": ("grpo", PAPER),
    "DAPO token mean (group std, paper's k3, token-mean)": ("grpo", dict(PAPER, loss_agg="token-mean")),
    "DAPO token mean, beta 0 (batch std)": ("grpo", dict(GRPO_RECIPE, beta=0.0, loss_agg="token-mean")),
    "Dr. GRPO (no std, seq-mean-token-sum-norm, beta 0)": (
        "grpo",
        dict(GRPO_RECIPE, scale_rewards="none", beta=0.0, loss_agg="seq-mean-token-sum-norm"),
    ),
    "GSPO (sequence ratio, group std, beta 0)": (
        "grpo",
        dict(PAPER, importance_level="sequence", clip_low=3e-4, clip_high=4e-4, beta=0.0),
    ),
    "PPO, verify.py's recommended dump (k1 penalty, GAE, adaptive KL)": ("ppo", PPO_RECIPE),
    "REINFORCE++ (PPO without a critic, --vf-coef 0 --lam 1: docs/fork.md)": (
        "ppo",
        dict(
            {k: v for k, v in PPO_RECIPE.items() if k not in ("critic_learning_rate", "cliprange_value")},
            vf_coef=0.0,
            lam=1.0,
        ),
    ),
}
# Each real difference the table shows: (peer, quantity, what differs, the peer's line that makes it, what it is).
# Its size is the largest the run measures for that peer and quantity, over the variants where it differs.
REAL_DIFFERENCES = [
    (
        "TRL 1.16",
        "log-probs",
        "the forward passes no position ids: a left-padded prompt is shifted on a model with "
        "absolute positions (tiny-gpt2); rotary models hide it",
        "trl/trainer/grpo_trainer.py, _get_per_token_logps_and_entropies",
        "undocumented choice (wrong on absolute positions)",
    ),
    (
        "TRL 1.16",
        "update",
        "the HF Trainer spares biases and norm weights from weight decay (with the log-probs above, on tiny-gpt2)",
        "transformers Trainer.get_decay_parameter_names",
        "documented choice",
    ),
    (
        "verl 0.9.1",
        "per-token loss",
        "dual clip on by default (clip_ratio_c 3 bounds the loss of a negative "
        "advantage at 3 |A|): tiny-gpt2's ratios pass 3",
        "verl/trainer/ppo/core_algos.py, compute_policy_loss_vanilla",
        "documented choice",
    ),
    (
        "verl 0.9.1",
        "advantages",
        "PPO: GAE's advantages whitened with the unbiased variance",
        "verl/utils/torch_functional.py, masked_whiten",
        "undocumented choice",
    ),
    (
        "OpenRLHF 0.11.2",
        "advantages",
        "GRPO: the group's std + 1e-9, whatever the config's eps",
        "openrlhf/trainer/ppo_utils/experience_maker.py, compute_advantages_and_returns",
        "undocumented choice",
    ),
    (
        "OpenRLHF 0.11.2",
        "loss",
        "GRPO: the KL term is aggregated as a token mean whatever --actor.loss_agg_mode (the policy loss follows "
        "the mode): on a seq-mean-token-mean dump the loss differs by beta x (token mean - sequence mean) of k3",
        "openrlhf/trainer/ray/ppo_actor.py, training_step (aggregate_loss(kl, action_mask, **loss_batch_info)); "
        "utils/loss_utils.py, get_loss_batch_info (no token_level_loss)",
        "undocumented choice",
    ),
    ("OpenRLHF 0.11.2", "gradient", "the same KL aggregation, on the gradient", "as the loss", "undocumented choice"),
    (
        "SkyRL 0.4.0",
        "advantages",
        "GRPO: the group's std + 1e-6 (the trainer passes no epsilon); PPO: GAE's "
        "advantages whitened with the unbiased variance",
        "skyrl/backends/skyrl_train/utils/ppo_utils.py, compute_grpo_outcome_advantage and masked_whiten",
        "undocumented choice",
    ),
    (
        "SkyRL 0.4.0",
        "loss",
        "GRPO: the KL loss is a per-sequence mean whatever loss_reduction (token_mean: the loss "
        "differs); PPO: the critic loss a per-sequence mean and the entropy loss a micro-batch's token mean, each "
        "times the micro-batch's share of sequences, ppo.py's a token mean over the minibatch",
        "skyrl/backends/skyrl_train/workers/worker.py, _forward_backward_micro (masked_mean(kl_loss, loss_mask, dim=-1)"
        ".mean(), masked_mean(entropy_BS, loss_mask), microbatch_weight); ppo_utils.py, ppo_critic_loss",
        "undocumented choice (a code comment says the KL is not pre-scaled)",
    ),
    ("SkyRL 0.4.0", "gradient", "the same aggregations, on the gradient", "as the loss", "undocumented choice"),
    (
        "AReaL 1.0.4",
        "advantages",
        "GRPO: the advantage normalised over tokens, so a group's mean (and std) weigh "
        "each completion by its length; PPO: (A - mean) / (std + 1e-5) with the unbiased std",
        "areal/trainer/ppo/actor.py, PPOActor._compute_advantages (self.adv_norm(advantages, loss_mask)); "
        "areal/utils/data.py, Normalization",
        "undocumented choice (GRPO), documented choice (PPO: NormConfig)",
    ),
]
COLUMNS = ["TRL 1.16", "verl 0.9.1", "OpenRLHF 0.11.2", "SkyRL 0.4.0", "AReaL 1.0.4"]
ADAPTERS = dict(zip(COLUMNS, ["trl", "verl", "openrlhf", "skyrl", "areal"]))
ROWS = [q for q in verify.QUANTITIES if q != "replay"]  # the replay checks the dump, not a peer


def options(column, script, args):
    """(--set pairs, --accept quantities): the peer's options aligned where it has one, every declared difference
    accepted within its bound."""
    name, pairs = ADAPTERS[column], []
    if name == "trl":
        pairs = [f"use_bias_correction_kl={str(bool(args['bias_corrected_kl'])).lower()}"]
    if name == "verl" and script == "grpo":
        pairs = [f"epsilon={args['adv_eps']}", f"loss_scale_factor={args['max_new_tokens']}"]
    adapter = verify.load_adapter(name)
    chosen = verify.parse_options(adapter, pairs)
    declared = adapter.known_differences(args, chosen) if hasattr(adapter, "known_differences") else {}
    return pairs, list(declared)


def make_dump(folder, script, flags):
    module = grpo if script == "grpo" else ppo
    fields = dict(flags, seed=1, sample_every=0)
    fields.update(output_dir=os.path.join(folder, "runs"), dump_dir=os.path.join(folder, "d"))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        module.main(module.Args(**fields))
    return os.path.join(folder, "d")


NOT_APPLICABLE = ("has none", "no KL term", "needs two", "constant without", "replayed by this project")


measured = {}  # (peer, quantity): the largest difference the run measured where the row differs


def cell(report, quantity, note, column=None):
    """One row of verify.py's table as a cell; `note(text)` numbers the reason a cell differs."""
    row, (kind, _) = report.rows[quantity], report.tolerances[quantity]
    status = report.status(quantity)
    if status == "skip":
        return "-" if any(part in (row["skip"] or "") for part in NOT_APPLICABLE) else "not implemented"
    value = report.largest(quantity) / (report.scale(quantity) if kind == "rel" else 1.0)
    size = f"{value:.0e}" if value else "0"
    if status == "pass":
        return f"agrees ({size})"
    measured[column, quantity] = max(measured.get((column, quantity), 0.0), value)
    if status == "known":
        return f"differs {size} [{note(describe_known(row['known']))}]"
    return f"**differs {size}** [{note(None)}]"


def available(column, verl_site):
    name = ADAPTERS[column]
    if name == "verl" and verl_site not in sys.path:
        sys.path.append(verl_site)
    try:
        verify.load_adapter(name)
    except verify.VerifyError as e:
        print(f"{column}: absent ({e})")
        return False
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=os.path.join(ROOT, "docs", "agreement.md"))
    parser.add_argument("--verl-site", default=os.path.join(ROOT, ".verl-site"), help="the folder verl is in")
    parser.add_argument("--modes", nargs="*", help="only the modes whose name contains one of these")
    opts = parser.parse_args()
    present = {c: available(c, opts.verl_site) for c in COLUMNS}
    lines = ["| variant | quantity | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    notes = []

    def note_for(column, mode):
        def note(text):
            if text is None:
                text = "; ".join(differences[column]) or "no difference declared: a bug?"
            entry = f"{column}, {mode}: {text}"
            if entry not in notes:
                notes.append(entry)
            return notes.index(entry) + 1

        return note

    with tempfile.TemporaryDirectory() as tmp:
        for i, (mode, (script, flags)) in enumerate(MODES.items()):
            if opts.modes and not any(part in mode for part in opts.modes):
                continue
            args, steps, _, _ = verify.load_dump(make_dump(os.path.join(tmp, str(i)), script, flags))
            cells, differences = {}, {}
            for column in COLUMNS:
                if not present[column] or (script == "ppo" and ADAPTERS[column] == "trl"):
                    cells[column] = {q: "absent" if not present[column] else "not implemented" for q in ROWS}
                    continue
                adapter = verify.load_adapter(ADAPTERS[column])
                pairs, accept = options(column, script, args)
                chosen = verify.parse_options(adapter, pairs)
                try:
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        report, _ = verify.verify(
                            args, steps, adapter, chosen, verify.parse_tolerances([], args["script"]), accept=accept
                        )
                except verify.AdapterError as e:  # verify.py's exit status 3: the adapter's own mistake, named
                    number = note_for(column, mode)(f"the adapter failed: {e}")
                    cells[column] = {q: f"**adapter error** [{number}]" for q in ROWS}
                    print(f"{mode[:40]} | {column} | adapter error: {e}", flush=True)
                    continue
                differences[column] = adapter.differences(args, chosen) if hasattr(adapter, "differences") else []
                cells[column] = {q: cell(report, q, note_for(column, mode), column) for q in ROWS}
                print(f"{mode[:40]} | {column} | {report.summary()[0][:100]}", flush=True)
            for q in ROWS:
                if all(cells[c][q] == "-" for c in COLUMNS if present[c]):
                    continue
                lines.append(f"| {mode} | {q} | " + " | ".join(cells[c][q] for c in COLUMNS) + " |")
    tolerances = ", ".join(f"{q} {kind} {value:g}" for q, (kind, value) in verify.TOLERANCES.items())
    header = f"""# Agreement with other implementations

Written by `python benchmarks/agreement.py` (its docstring says how). Each variant is verify.py's recommended dump
with the variant's flags; each cell is the row of `python verify.py DUMP --against PEER [--set ...] [--accept
...]` for that quantity: "agrees (size)" within the row's tolerance, "differs size [n]" (bold: beyond every bound
the peer's adapter declares; plain: a known difference the adapter declares, within its bound), "not implemented"
(the peer has no such computation or the adapter cannot reach it: verify.py says why), "-" (no such quantity in
this variant). Sizes are the largest difference over the steps, in the row's kind (relative: over the row's
scale). Tolerances: {tolerances}. The peers' options are aligned where they have one (TRL's
use_bias_correction_kl, verl's epsilon and loss_scale_factor).

"""
    os.makedirs(os.path.dirname(opts.output), exist_ok=True)
    with open(opts.output, "w") as f:
        f.write(header + "\n".join(lines) + "\n\n## The differences\n\n")
        f.write("\n".join(f"{n}. {text}" for n, text in enumerate(notes, 1)) + "\n")
        f.write(
            "\n## Each real difference\n\nThe largest size measured above (in the row's kind), the peer's line that "
            "makes it, and whether the peer documents it.\n\n| peer | quantity | the difference | size | where | what "
            "it is |\n|---|---|---|---|---|---|\n"
        )
        for column, quantity, what, where, kind in REAL_DIFFERENCES:
            size = measured.get((column, quantity))
            size = f"{size:.0e}" if size is not None else "not measured in this run"
            f.write(f"| {column} | {quantity} | {what} | {size} | {where} | {kind} |\n")
    print(f"wrote {opts.output}")


if __name__ == "__main__":
    main()
