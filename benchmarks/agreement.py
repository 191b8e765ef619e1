"""The agreement table: each peer (TRL, verl, this project itself) against fresh dumps of each mode.

    python benchmarks/agreement.py                            # writes docs/agreement.md, about 1 minute on CPU
    python benchmarks/agreement.py --verl-site .verl-site     # where verl is (requirements/verl.txt)
    OPENRLHF_SITE=.openrlhf-site python benchmarks/agreement.py   # OpenRLHF: .openrlhf-site by default
    python benchmarks/agreement.py --modes OpenRLHF "PPO, verify"   # only the modes whose name holds one of these

Each mode is a short run of grpo.py or ppo.py on the tiny model (GRPO: 3 steps at learning rate 1e-2, so the
policy has left the reference by step 2), dumped, then recomputed by each peer through verify.py: with the
peer's defaults, then with the known differences aligned by the peer's options. A cell is the largest
difference over the steps (the gradient's relative to its largest element, the rest absolute); bold fails.
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

GROUP = dict(scale_rewards="group")
# verify.py's recommended dumps (its docstring): every branch of every row exercised.
GRPO_RECIPE = dict(
    model="tiny-gpt2",
    task="copy:1-3",
    num_iterations=2,
    learning_rate=1e-3,
    clip_low=0.05,
    clip_high=0.05,
    beta=0.1,
    max_new_tokens=4,
    prompts_per_step=16,
    group_size=8,
    temperature=0.8,
    weight_decay=1.0,
)
PPO_RECIPE = dict(
    model="tiny-gpt2",
    task="copy:1-3",
    num_steps=3,
    prompts_per_step=16,
    critic_learning_rate=1e-2,
    clip_low=0.05,
    clip_high=0.05,
    cliprange_value=0.01,
    target_kl=1.2,
    kl_horizon=100,
    max_new_tokens=4,
    temperature=0.8,
    gamma=0.95,
    micro_batch_size=4,
)
MODES = {
    "GRPO, verify.py's recommended dump": ("grpo", GRPO_RECIPE),
    "GRPO, recommended, --no-decay-norms-and-biases (the HF Trainer's groups)": (
        "grpo",
        dict(GRPO_RECIPE, decay_norms_and_biases=False),
    ),
    "GRPO, recommended, OpenRLHF's settings (group std, --adv-eps 1e-9, paper's k3)": (
        "grpo",
        dict(GRPO_RECIPE, scale_rewards="group", adv_eps=1e-9, bias_corrected_kl=False),
    ),
    "PPO, verify.py's recommended dump": ("ppo", PPO_RECIPE),
    "GRPO paper (group std, seq-mean-token-mean, beta 0.1)": ("grpo", dict(GROUP, beta=0.1, bias_corrected_kl=False)),
    "GRPO, --bias-corrected-kl": ("grpo", dict(GROUP, beta=0.1, bias_corrected_kl=True)),
    "DAPO (token-mean, clip-high 0.28, beta 0)": ("grpo", dict(GROUP, loss_agg="token-mean", clip_high=0.28, beta=0.0)),
    "Dr. GRPO (no std, seq-mean-token-sum-norm)": (
        "grpo",
        dict(scale_rewards="none", beta=0.0, loss_agg="seq-mean-token-sum-norm"),
    ),
    "GSPO (sequence ratio, 2 iterations)": (
        "grpo",
        dict(importance_level="sequence", num_iterations=2, clip_low=3e-4, clip_high=4e-4, beta=0.0),
    ),
    "GRPO, --weight-decay 0.1": ("grpo", dict(GROUP, beta=0.1, bias_corrected_kl=True, weight_decay=0.1)),
    "GRPO, --weight-decay 0.1 --no-decay-norms-and-biases": (
        "grpo",
        dict(GROUP, beta=0.1, bias_corrected_kl=True, weight_decay=0.1, decay_norms_and_biases=False),
    ),
    "PPO (k1 penalty, GAE 1 / 0.95)": ("ppo", dict()),
    "PPO (k3 penalty, GAE 0.9 / 0.8, micro-batches of 4)": (
        "ppo",
        dict(kl_estimator="k3", gamma=0.9, lam=0.8, micro_batch_size=4),
    ),
}


def peers(script, args, with_verl, with_openrlhf):
    """(label, adapter, --set pairs, --accept quantities): each peer with its defaults, then with the known
    differences aligned or accepted."""
    out = [("this project", "self", [])]
    if script == "grpo":
        same_kl = f"use_bias_correction_kl={str(bool(args['bias_corrected_kl'])).lower()}"
        out += [("TRL 1.16 GRPOTrainer", "trl", []), ("TRL 1.16, " + same_kl, "trl", [same_kl])]
    if with_verl:
        out.append(("verl 0.9.1 core_algos", "verl", []))
        if script == "grpo":
            aligned = ["epsilon=1e-4", f"loss_scale_factor={args['max_new_tokens']}"]
            out.append(("verl 0.9.1, " + " ".join(aligned), "verl", aligned))
    out = [(label, name, pairs, []) for label, name, pairs in out]
    if with_openrlhf:
        out.append(("OpenRLHF 0.11.2", "openrlhf", [], []))
        openrlhf = verify.load_adapter("openrlhf")
        known = list(openrlhf.known_differences(args, dict(openrlhf.OPTIONS)))
        if known:
            out.append(("OpenRLHF 0.11.2, --accept " + " ".join(known), "openrlhf", [], known))
    return out


def make_dump(folder, script, flags):
    module = grpo if script == "grpo" else ppo
    size = dict(num_steps=3, prompts_per_step=4, group_size=4) if script == "grpo" else dict(num_steps=1)
    fields = dict(dict(seed=1, max_new_tokens=6, learning_rate=1e-2, sample_every=0, **size), **flags)
    fields.update(output_dir=os.path.join(folder, "runs"), dump_dir=os.path.join(folder, "d"))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        module.main(module.Args(**fields))
    return os.path.join(folder, "d")


def cell(report, quantity):
    row, (kind, _) = report.rows[quantity], report.tolerances[quantity]
    if not row["steps"]:
        return "-"
    value = report.largest(quantity) / (report.scale(quantity) if kind == "rel" else 1.0)
    text = (f"{value:.0e}" if value else "0") + ("*" if report.unexercised(quantity) else "")
    status = report.status(quantity)
    if status == "known":
        return f"{text} (known)"
    return text if status == "pass" else f"**{text}**"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=os.path.join(ROOT, "docs", "agreement.md"))
    parser.add_argument("--verl-site", default=os.path.join(ROOT, ".verl-site"), help="the folder verl is in")
    parser.add_argument("--modes", nargs="*", help="only the modes whose name contains one of these")
    opts = parser.parse_args()
    sys.path.append(opts.verl_site)
    try:
        import verl.trainer.ppo.core_algos  # noqa: F401
    except ImportError:
        print(f"no verl in {opts.verl_site}: its rows are left out (see requirements/verl.txt)")
        with_verl = False
    else:
        with_verl = True
    try:
        verify.load_adapter("openrlhf")
    except verify.VerifyError:
        print("no openrlhf (OPENRLHF_SITE or .openrlhf-site): its rows are left out (see requirements/openrlhf.txt)")
        with_openrlhf = False
    else:
        with_openrlhf = True
    columns = "| peer | mode | " + " | ".join(verify.QUANTITIES) + " | result | why they differ |"
    lines = [columns, "|---" * (len(verify.QUANTITIES) + 4) + "|"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (mode, (script, flags)) in enumerate(MODES.items()):
            if opts.modes and not any(part in mode for part in opts.modes):
                continue
            args, steps, _, _ = verify.load_dump(make_dump(os.path.join(tmp, str(i)), script, flags))
            for label, name, pairs, accept in peers(script, args, with_verl, with_openrlhf):
                adapter = verify.load_adapter(name)
                options = verify.parse_options(adapter, pairs)
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    report, _ = verify.verify(
                        args, steps, adapter, options, verify.parse_tolerances([], args["script"]), accept=accept
                    )
                failures = report.failures()
                why = "<br>".join(adapter.differences(args, options)) if failures else ""
                cells = " | ".join(cell(report, q) for q in verify.QUANTITIES)
                status = report.summary()[1]  # a pass needs the advantages and a loss row compared
                result = (
                    "fail: " + ", ".join(failures) if failures else "pass" if status == 0 else "too little compared"
                )
                lines.append(f"| {label} | {mode} | {cells} | {result} | {why} |")
                print(lines[-1][:150], flush=True)
    tolerances = ", ".join(f"{q} {kind} {value:g}" for q, (kind, value) in verify.TOLERANCES.items())
    header = f"""# Agreement with other implementations

Written by `python benchmarks/agreement.py` (its docstring says how). Each row is `python verify.py DUMP
--against PEER [--set ...]` on a fresh dump of the mode: the largest difference over the steps checked,
in the row's tolerance kind (relative: over the row's scale, the largest of ours over every step); `-` is a check
not made (the peer cannot, or the mode has no such quantity: run verify.py for the reason). Tolerances:
{tolerances}. A failing row lists the known differences its flags switch on; the aligned row under it shows
whether they are the whole story; "(known)" is a difference the adapter declares and the row accepts (`--accept`)
within the bound the adapter declares. A `*` marks a row whose dump never exercised a branch it checks (verify.py
names it): verify.py's recommended dumps exercise every one.

"""
    os.makedirs(os.path.dirname(opts.output), exist_ok=True)
    with open(opts.output, "w") as f:
        f.write(header + "\n".join(lines) + "\n")
    print(f"wrote {opts.output}")


if __name__ == "__main__":
    main()
