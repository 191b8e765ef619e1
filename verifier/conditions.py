"""What a dump exercises: the branches a loss row reads off this project's own per-token terms, and the settings a
dump keeps equal, so that a bug confusing the two would not show (named on the PASS line, in a user's words).
"""

import torch

from verifier.report import EARLY


def equal_pairs(args):
    """The settings of a dump that a confusion of two of them could not show: one line each."""
    ppo, out = args["script"] == "ppo", []
    if args["clip_low"] == args["clip_high"]:
        out.append("--clip-low equals --clip-high: swapped clip bounds would not show")
    if ppo and args["gamma"] == args["lam"]:
        out.append("--gamma equals --lam: gamma and lambda swapped would not show")
    if ppo and args["vf_coef"] > 0 and args["learning_rate"] == args["critic_learning_rate"]:
        out.append(
            "--learning-rate equals --critic-learning-rate: a critic stepped at the policy's rate would not show"
        )
    if args["warmup_steps"] == 0:
        out.append("no --warmup-steps: the learning rate never moves, so a schedule a step late would not show")
    return out


def controller_conditions(report, error):
    """PPO's adaptive KL controller at one step: the KL's relative error from the target, and which side of the
    clip at +-0.2 it reached (each side apart: a wrong upper clip shows only past the upper one)."""
    report.exercise("kl_coef", "a KL error within +-0.2 of the target (not clipped)", abs(error) < 0.2)
    report.exercise("kl_coef", "a KL error below -0.2 (the controller's lower clip)", error < -0.2)
    report.exercise("kl_coef", "a KL error above +0.2 (the controller's upper clip)", error > 0.2)


def loss_conditions(report, quantities, ref, batch, args):
    """What a loss row exercises on this batch, read from this project's own per-token terms: what the loss clipped
    is its own `clipped` term (and `value_clipped`), so a variant that clips otherwise is described as it is."""
    _, terms = ref._loss(batch, args)
    if "logratio" not in terms or "advantages" not in terms:  # a loss without a ratio: nothing to say
        return
    real = batch["completion_mask"].bool()
    ends_early = (real[:, -1] == 0).any()
    ratio = terms["logratio"].exp()[real]
    clipped = terms["clipped"][real] if "clipped" in terms else None  # the loss's own: a loss without a clip has none
    for q in quantities:
        report.exercise(q, "a ratio away from 1", ((ratio - 1).abs() > 1e-6).any())
        report.exercise(q, EARLY, ends_early)  # the aggregation's denominators differ
        if clipped is not None:
            below, above = clipped & (ratio < 1), clipped & (ratio > 1)
            report.exercise(q, "a token the loss clipped, its ratio below 1", below.any())
            report.exercise(q, "a token the loss clipped, its ratio above 1", above.any())
            # out of the range the loss itself clipped at (read off its mask, not --clip-low/--clip-high: a variant
            # may clip elsewhere): a ratio as far from 1 as one it clipped, on the same side, left unclipped
            low = ratio[below].max() if below.any() else -torch.inf
            high = ratio[above].min() if above.any() else torch.inf
            out = (ratio <= low) | (ratio >= high)
            report.exercise(q, "a ratio out of the clip range that the loss did not clip", (out & ~clipped).any())
        if "new_values" in terms and "old_values" in terms:
            moved = (terms["new_values"] - terms["old_values"])[real]
            report.exercise(q, "values moved from the rollout's", (moved != 0).any())
            if "value_clipped" in terms:
                report.exercise(q, "a value the loss clipped", terms["value_clipped"][real].any())
            report.exercise(q, "a micro-batch smaller than its minibatch", batch["num_seqs"] > len(real))
            report.exercise(q, "an entropy bonus (--ent-coef > 0)", args["ent_coef"] > 0)
        else:
            report.exercise(q, "a KL term (--beta > 0)", args["beta"] > 0)
            report.exercise(q, "a KL that is not 0", "kl_ref" in terms and (terms["kl_ref"][real] != 0).any())
