"""Preference pairs for reward_model.py (--task): the built-in synthetic task, or your JSONL file.

    synthetic    the copy task's prompts ("123="), two completions of each sampled from --model (the policy that
                 PPO or GRPO will start from), the preferred one drawn with P(a over b) = sigmoid(beta (gold(a) -
                 gold(b))), gold being rewards.graded_copy_reward, which the policy never sees
    jsonl:PATH   one pair a line, {"prompt": "...", "chosen": "...", "rejected": "..."} (the standard form TRL and
                 OpenRLHF read), or the conversational form: "prompt" the turns before the reply, "chosen" and
                 "rejected" the replies, each a list of {"role": ..., "content": ...} messages; without "prompt",
                 "chosen" and "rejected" are whole conversations whose shared first turns are the prompt (TRL's
                 implicit prompt). 10% of the prompts are held out, as tasks.split_examples does.

A pair is {"prompt", "chosen", "rejected"} (strings, or lists of messages) and the other fields of its line (a
`margin`: numbers as int or float); a synthetic one also keeps its gold rewards. models.reward_texts renders a
pair's two halves as the reward model reads them.
"""

import json
import math
import random

from machinery.errors import UsageError, shorten
from tasks import copy_task, split_examples
from tasks.rewards import graded_copy_reward
from tasks.user import other_fields, read_jsonl

PAIR_FORM = '{"prompt": "...", "chosen": "...", "rejected": "..."}'


def preference_probability(gold_a, gold_b, beta):
    """The Bradley-Terry model (Bradley and Terry 1952; Christiano et al. 2017, eq. 1), the probability that a
    labeller prefers a to b: P(a > b) = sigmoid(beta * (gold(a) - gold(b))). Equal rewards give 1/2; the larger beta,
    the less noise (beta = 30 prefers a gold reward higher by 0.1 95 times in 100)."""
    return 1 / (1 + math.exp(-beta * (gold_a - gold_b)))


def synthetic_pairs(sample, examples, n_pairs, beta, seed, batch=256, max_rounds=100):
    """`n_pairs` pairs on the prompts of `examples`: two completions of a prompt, `sample(prompts)` twice (the initial
    policy's), labelled through preference_probability of their graded_copy_reward. A pair with an empty completion or
    two of the same gold reward (two equal completions among them: no labeller could prefer one) is drawn again."""
    rng, pairs = random.Random(seed), []
    for _ in range(max_rounds):
        drawn = [rng.choice(examples) for _ in range(batch)]
        prompts = [example["prompt"] for example in drawn]
        for example, a, b in zip(drawn, sample(prompts), sample(prompts)):
            gold_a, gold_b = (graded_copy_reward(example["prompt"], y, example["answer"]) for y in (a, b))
            if not a or not b or gold_a == gold_b:
                continue
            if rng.random() >= preference_probability(gold_a, gold_b, beta):
                a, b, gold_a, gold_b = b, a, gold_b, gold_a
            pairs.append(dict(prompt=example["prompt"], chosen=a, rejected=b, gold_chosen=gold_a, gold_rejected=gold_b))
        if len(pairs) >= n_pairs:
            return pairs[:n_pairs]
    raise UsageError(
        f"the policy gave {len(pairs)} usable pairs in {max_rounds * batch} draws, not {n_pairs} (its completions are "
        "empty or equal): lower --num-pairs, or sample from a model that writes varied completions"
    )


def message_list(value, key, where):
    """`value` as a list of {"role": str, "content": str} messages, or a UsageError naming the key."""
    if not (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)
        and all(isinstance(m.get("content"), str) for m in value)
    ):
        raise UsageError(
            f'{where}: "{key}" must be a string, or a non-empty list of {{"role": "...", "content": "..."}} '
            f"messages, not {shorten(value)}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def check_pair(row, where):
    """`row` as a pair {"prompt", "chosen", "rejected"}, or a UsageError saying what is wrong at `where`: a missing
    field, a field that is not text (or messages), an empty completion, a chosen equal to its rejected."""
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected an object like {PAIR_FORM}, not {shorten(row)}")
    conversational = isinstance(row.get("chosen"), list)
    needed = ("chosen", "rejected") if conversational else ("prompt", "chosen", "rejected")
    for key in needed:
        if key not in row:
            raise UsageError(f'{where}: the key "{key}" is missing; every pair needs "prompt", "chosen" and "rejected"')
    if conversational:
        chosen, rejected = (message_list(row[key], key, where) for key in ("chosen", "rejected"))
        if isinstance(row.get("prompt"), str):  # a plain prompt before conversational replies: the user's turn
            prompt = [{"role": "user", "content": row["prompt"]}]
        elif "prompt" in row:
            prompt = message_list(row["prompt"], "prompt", where)
        else:  # TRL's implicit prompt: the turns the two conversations share
            shared = next(
                (i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r), min(map(len, (chosen, rejected)))
            )
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
            if not prompt:
                raise UsageError(f'{where}: "chosen" and "rejected" share no first turn: give the "prompt" turns')
        texts = ["".join(m["content"] for m in reply) for reply in (chosen, rejected)]
    else:
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        for key in needed:
            if not isinstance(row[key], str):
                raise UsageError(f'{where}: "{key}" must be a string like the others, not {shorten(row[key])}')
        texts = [chosen, rejected]
    for key, text in zip(("chosen", "rejected"), texts):
        if not text.strip():
            raise UsageError(f'{where}: "{key}" is empty: a pair compares two written completions')
    if chosen == rejected:
        raise UsageError(f'{where}: "chosen" equals "rejected" ({shorten(texts[0])}): a pair needs two different ones')
    kept = other_fields(row, ("prompt", "chosen", "rejected"))  # a variant's `margin`, as int or float
    return {**kept, "prompt": prompt, "chosen": chosen, "rejected": rejected, "where": where}


def load_pairs(name, sample, n_pairs, beta, seed):
    """(train, held out) pairs of --task `name`; `sample(prompts)` draws the synthetic task's completions."""
    if name == "synthetic":
        task = copy_task()
        return (
            synthetic_pairs(sample, task.train, n_pairs, beta, seed),
            synthetic_pairs(sample, task.test, max(1, n_pairs // 10), beta, seed + 1),
        )
    kind, _, path = name.partition(":")
    if kind != "jsonl" or not path:
        raise UsageError(f"unknown task {name!r} for a reward model: pass --task synthetic or jsonl:PATH of pairs")
    pairs = read_jsonl(path, check_pair, PAIR_FORM)
    keyed = [dict(pair, prompt=json.dumps(pair["prompt"]), pair=pair) for pair in pairs]  # a prompt of messages too
    return tuple([row["pair"] for row in rows] for rows in split_examples(name, keyed))
