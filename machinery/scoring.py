"""The task's rewards on the completion's tokens: an outcome score at the last real token, a dense reward on the
tokens that earned it, checked to be causal. What grpo.py and ppo.py call between sampling and the advantage
(common.rollout calls score_tokens); the reward functions themselves are in tasks/rewards.py and
tasks/__init__.py.
"""

import os

import torch

from machinery.errors import UsageError, shorten


def score_at_last_token(scores, mask):
    """Place each completion's score at its last real token: [B] -> [B, T], zero elsewhere.

    The last real token is the last position where mask is 1 (the EOS, or the last generated token when
    there was none), so the score never lands on padding, whichever side the padding is on.
    """
    T = mask.shape[1]
    last = T - 1 - mask.flip(1).argmax(1)  # [B]
    placed = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    return placed.scatter(1, last[:, None], scores[:, None]) * mask


def token_ends(tokenizer, ids, text):
    """For each token of a completion, how many characters of its `text` are written once that token is: [n].

    Each prefix of the ids is decoded: a token that ends inside a multi-byte character (byte-level tokenizers
    split them) decodes to U+FFFD there, so that character counts as written by the token that completes it.
    """
    prefixes = tokenizer.batch_decode([ids[: k + 1] for k in range(len(ids))], skip_special_tokens=False)
    ends, written = [], 0
    for prefix in prefixes:
        written = max(written, len(os.path.commonprefix([prefix, text])))
        ends.append(written)
    return ends


def place_dense(reward, ends, mask_row):
    """A dense reward on its completion's real tokens, [T]: a list of numbers is one per real token (EOS
    included); a list of (start, end, value) spans of the text puts each value on the token that writes the
    span's last character. The k-th real token is the k-th 1 of mask_row, whichever side the padding is on."""
    real = mask_row.nonzero()[:, 0]  # positions of the real tokens
    placed = torch.zeros(mask_row.shape, dtype=torch.float32, device=mask_row.device)
    if reward and not isinstance(reward[0], tuple):
        placed[real] = torch.tensor(reward, dtype=torch.float32, device=mask_row.device)
        return placed
    for _, end, value in reward:
        placed[real[next((k for k, e in enumerate(ends) if e >= end), len(ends) - 1)]] += value
    return placed


def score_tokens(scorer, tokenizer, prompts, completions, answers, completion_ids, completion_mask):
    """The rewards of `scorer` (a task, or a reward model) on the completions' tokens, [B, T], 0 on padding.

    A number is an outcome score, placed at the last real token; a dense reward (see tasks.Task.score) is
    placed where it was earned, so each row sums to the completion's total reward.
    """
    ids = [row[m.bool()].tolist() for row, m in zip(completion_ids, completion_mask)]
    wants_tokens = getattr(scorer, "wants_tokens", False)
    ends = [token_ends(tokenizer, i, c) if wants_tokens else None for i, c in zip(ids, completions)]
    pieces = [[c[a:b] for a, b in zip([0, *e], e)] for c, e in zip(completions, ends)] if wants_tokens else None
    extra = {"tokens": pieces} if wants_tokens else {}  # only a task whose reward function asks for them
    rewards = scorer.score(prompts, completions, answers, **extra)
    outcome = [r if not isinstance(r, list) else 0.0 for r in rewards]
    placed = score_at_last_token(torch.tensor(outcome, device=completion_mask.device), completion_mask)
    for i, r in enumerate(rewards):
        if isinstance(r, list):
            if r and not isinstance(r[0], tuple) and len(r) != len(ids[i]):
                raise UsageError(
                    f"reward function of task {scorer.name!r} returned {len(r)} per-token values on prompt "
                    f"{shorten(prompts[i])}, whose completion has {len(ids[i])} tokens (EOS included): "
                    "return one a token"
                )
            ends[i] = ends[i] or token_ends(tokenizer, ids[i], completions[i])
            placed[i] = place_dense(r, ends[i], completion_mask[i])
    # Spans, or per-token values from a function that sees the tokens (one that does not cannot tell a prefix
    # from a completion without EOS): checked to be causal on the longest completion, the likeliest to show it.
    dense = [
        i for i, r in enumerate(rewards) if isinstance(r, list) and (wants_tokens or not r or isinstance(r[0], tuple))
    ]
    if dense:
        i = max(dense, key=lambda i: len(ids[i]))
        paid = placed[i][completion_mask[i].bool()].cumsum(0).tolist()  # paid to the first k + 1 tokens
        piece = pieces[i] if pieces else None
        check_causal(scorer, prompts[i], completions[i], answers[i], ends[i], piece, paid)
    return placed


def check_causal(scorer, prompt, completion, answer, ends, pieces, paid):
    """A dense reward is per-token credit only if no token changes what an earlier one was paid: called on the
    text of the first k tokens, the function must total what those k tokens were paid in the whole completion
    (so the values are r_t = R(y<=t) - R(y<t) of an outcome R, which sum to R). `paid`: the running total."""
    n = len(ends) - 1  # the last prefix is the completion itself
    extra = {"tokens": [pieces[: k + 1] for k in range(n)]} if pieces is not None else {}
    try:
        totals = scorer.score([prompt] * n, [completion[: ends[k]] for k in range(n)], [answer] * n, **extra)
    except UsageError as e:
        raise UsageError(
            f"on a prefix of completion {shorten(completion)} (checking that the dense reward is "
            f"causal, see docs/tasks.md, Reward functions): {e}"
        ) from None
    for k, total in enumerate(totals):
        total = sum(v[2] if isinstance(v, tuple) else v for v in total) if isinstance(total, list) else total
        if abs(total - paid[k]) > 1e-5 * max(1.0, abs(total)):
            raise UsageError(
                f"reward function of task {scorer.name!r} is not causal: on prompt {shorten(prompt)}, the first "
                f"{k + 1} token(s) of completion {shorten(completion)} were paid {paid[k]:.6g} in all, but it gives "
                f"their text {shorten(completion[: ends[k]])} {total:.6g}: pay each token what it changes, "
                "R(y<=t) - R(y<t)"
            )
