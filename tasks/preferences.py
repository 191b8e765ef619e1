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
`margin`: numbers as int or float); a synthetic one also keeps its gold rewards. learnt_reward.reward_texts renders a
pair's two halves as the reward model reads them.
"""

import json
import math
import random
import types
from decimal import Decimal

from machinery import learnt_reward, model_checks, models
from machinery.errors import UsageError, shorten
from tasks import copy_task, split_examples
from tasks.rewards import graded_copy_reward
from tasks.user import other_fields, read_jsonl

PAIR_FORM = '{"prompt": "...", "chosen": "...", "rejected": "..."}'


def preference_probability(gold_a, gold_b, beta):
    """The Bradley-Terry model (Bradley and Terry 1952; Christiano et al. 2017, eq. 1), the probability that a
    labeller prefers a to b: P(a > b) = sigmoid(beta * (gold(a) - gold(b))). Equal rewards give 1/2; the larger beta,
    the less noise (beta = 30 prefers a gold reward higher by 0.1 95 times in 100). exp() only of a number <= 0, so
    no beta overflows it."""
    x = beta * (gold_a - gold_b)
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


BATCH, MAX_ROUNDS = 256, 100  # the synthetic task draws pairs BATCH at a time, at most MAX_ROUNDS times


def check_synthetic_sizes(n_pairs):
    """Before anything is sampled: --num-pairs within the draws synthetic_pairs makes at most."""
    if n_pairs > BATCH * MAX_ROUNDS:
        raise UsageError(
            f"--num-pairs is {n_pairs}: the synthetic task draws at most {BATCH * MAX_ROUNDS} pairs from the "
            f"policy, so pass at most {BATCH * MAX_ROUNDS}, or write your pairs to a file (--task jsonl:PATH)"
        )


def synthetic_pairs(sample, examples, n_pairs, beta, seed, batch=BATCH, max_rounds=MAX_ROUNDS):
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


def shown(value):
    """A value of a JSON line as the line writes it, for messages: JSON numbers arrive as Decimal (read_jsonl)."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() and abs(value.adjusted()) < 30 else float(value)
    if isinstance(value, list):
        return [shown(v) for v in value]
    if isinstance(value, dict):
        return {k: shown(v) for k, v in value.items()}
    return value


def text(value, key, where):
    """`value`, a string that UTF-8 can write, or a UsageError naming `key` (a lone surrogate is not a character)."""
    if not isinstance(value, str):
        raise UsageError(f"{where}: {key} must be a string, not {shorten(shown(value))}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(
            f"{where}: {key} holds {value[e.start : e.end]!r}, half of a surrogate pair, which is not a character: "
            "remove it or write the whole character"
        ) from None
    return value


def message_list(value, key, where):
    """`value` as a list of {"role": str, "content": str} messages, or a UsageError naming the key, and the message
    and field at fault."""
    if not isinstance(value, list) or not value:
        raise UsageError(
            f'{where}: "{key}" must be a string, or a non-empty list of {{"role": "...", "content": "..."}} '
            f"messages, not {shorten(shown(value))}"
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise UsageError(
                f'{where}: "{key}"[{i}] must be a message {{"role": "...", "content": "..."}}, not '
                f"{shorten(shown(message))}"
            )
        fields = [text(message.get(field), f'"{key}"[{i}]["{field}"]', where) for field in ("role", "content")]
        messages.append(dict(zip(("role", "content"), fields)))
    return messages


def check_pair(row, where):
    """`row` as a pair {"prompt", "chosen", "rejected"}, or a UsageError saying what is wrong at `where`: a missing
    field, a field that is not text (or messages), an empty completion, a chosen equal to its rejected."""
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected an object like {PAIR_FORM}, not {shorten(shown(row))}")
    conversational = isinstance(row.get("chosen"), list)
    needed = ("chosen", "rejected") if conversational else ("prompt", "chosen", "rejected")
    for key in needed:
        if key not in row:
            raise UsageError(f'{where}: the key "{key}" is missing; every pair needs "prompt", "chosen" and "rejected"')
    kinds = ["a list of messages" if isinstance(row[key], list) else "a string" for key in ("chosen", "rejected")]
    if kinds[0] != kinds[1] and all(isinstance(row[key], (list, str)) for key in ("chosen", "rejected")):
        raise UsageError(
            f'{where}: "chosen" is {kinds[0]} and "rejected" {kinds[1]}: write the two completions in one form '
            f"(two strings, or two lists of messages)"
        )
    if conversational:
        chosen, rejected = (message_list(row[key], key, where) for key in ("chosen", "rejected"))
        if chosen == rejected:
            raise UsageError(f'{where}: "chosen" equals "rejected": a pair needs two different conversations')
        if isinstance(row.get("prompt"), str):  # a plain prompt before conversational replies: the user's turn
            prompt = [{"role": "user", "content": text(row["prompt"], '"prompt"', where)}]
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
        prompt, chosen, rejected = (text(row[key], f'"{key}"', where) for key in needed)
        texts = [chosen, rejected]
    for key, written in zip(("chosen", "rejected"), texts):
        if not written.strip():
            what = "is empty" if written == "" or written == [] else "holds only whitespace"
            if conversational and "prompt" not in row:
                what += " after the turns it shares with the other"
            raise UsageError(f'{where}: "{key}" {what}: a pair compares two written completions')
    if chosen == rejected:
        raise UsageError(f'{where}: "chosen" equals "rejected" ({shorten(texts[0])}): a pair needs two different ones')
    kept = other_fields(row, ("prompt", "chosen", "rejected"), where)  # a variant's `margin`, as int or float
    return {**kept, "prompt": prompt, "chosen": chosen, "rejected": rejected, "where": where}


def pair_texts(pair):
    """Every string of a pair as written: the prompt, chosen and rejected, or their messages' contents."""
    for key in ("prompt", "chosen", "rejected"):
        value = pair[key]
        yield from ([m["content"] for m in value] if isinstance(value, list) else [value])


def synthetic_task_pairs(sample, n_pairs, beta, seed):
    """(train, held out) pairs of the synthetic task: on the copy task's training prompts, and a tenth as many on its
    held-out ones."""
    task = copy_task()
    return (
        synthetic_pairs(sample, task.train, n_pairs, beta, seed),
        synthetic_pairs(sample, task.test, max(1, n_pairs // 10), beta, seed + 1),
    )


def load_pairs(name, sample, n_pairs, beta, seed):
    """(train, held out) pairs of --task `name`, as written (load_task checks them against the model too);
    `sample(prompts)` draws the synthetic task's completions."""
    if name == "synthetic":
        return synthetic_task_pairs(sample, n_pairs, beta, seed)
    kind, _, path = name.partition(":")
    if kind != "jsonl" or not path:
        raise UsageError(f"unknown task {name!r} for a reward model: pass --task synthetic or jsonl:PATH of pairs")
    pairs = read_jsonl(path, check_pair, PAIR_FORM)
    keyed = [dict(pair, prompt=json.dumps(pair["prompt"]), pair=pair) for pair in pairs]  # a prompt of messages too
    return tuple([row["pair"] for row in rows] for rows in split_examples(name, keyed))


def reward_tokenizer(args):
    """The tokenizer of --model as the reward model reads with it: with --no-chat-template its template dropped (and
    saved so, so that ppo.py's --reward-model reads the plain texts too)."""
    tokenizer = models.load_tokenizer(args.model)
    if not args.chat_template:
        tokenizer.chat_template = None
    return tokenizer


def load_task(name, args):
    """--task `name` of reward_model.py, checked before any weight loads: synthetic (its pairs are sampled later, by
    synthetic_task_pairs: train and test None here; its prompts checked as the pairs of a file are), or
    jsonl:PATH, every line read and checked (check_pair), every character against the tokenizer of --model, every
    pair's length against its positions, and the memory a step needs."""
    from transformers import AutoConfig

    tokenizer = reward_tokenizer(args)
    config = models.from_pretrained(AutoConfig, models.resolve_model_path(args.model))
    model_checks.check_reward_model_config(config, args.model, "--model")
    if name == "synthetic":
        task = types.SimpleNamespace(name=name, train=None, test=None)
        copy = copy_task()
        prompts = [example["prompt"] for example in copy.train]
        # The policy samples --max-new-tokens after each prompt, as grpo.py does: refused as grpo.py refuses it.
        sampled = types.SimpleNamespace(name=copy.name, train=copy.train, test=copy.test, answers="data")
        models.check_prompt_length(
            tokenizer, sampled, types.SimpleNamespace(config=config), args.model, args.max_new_tokens, True
        )
        shortest = shortest_pair(tokenizer, prompts)
    else:
        train, test = load_pairs(name, None, 0, 0.0, 0)
        task, pairs = types.SimpleNamespace(name=name, train=train, test=test), train + test
        check_vocabulary(tokenizer, pairs, args.model)
        check_lengths(tokenizer, pairs, config.get_text_config(), args.model)
        shortest = shortest_pair(tokenizer, [pair["prompt"] for pair in pairs])
    model_checks.check_pairs_fit(args, config, shortest)
    check_batch_size(args.batch_size, args.num_pairs if task.train is None else len(task.train))
    return task


MIN_BATCH_BOUND = 1024  # a --batch-size up to this is never refused for repeating pairs


def check_batch_size(batch_size, n_train):
    """A step's batch of more pairs than the training data holds each pair several times: the gradient of one pass
    over them at that many times its cost; --batch-size 1000000 would tokenise two million texts before step 1's
    update. Refused past max(n_train, MIN_BATCH_BOUND)."""
    bound = max(n_train, MIN_BATCH_BOUND)
    if batch_size > bound:
        raise UsageError(
            f"--batch-size {batch_size} is more than the {n_train} training pairs (and than {MIN_BATCH_BOUND}): a step "
            f"would hold each pair about {batch_size // max(n_train, 1)} times; pass at most {bound}"
        )


def check_vocabulary(tokenizer, pairs, model_name):
    """Refuse pairs with characters the tokenizer of --model cannot write (it would read them as <unk>: two
    completions in unknown letters would get the same score, a margin of exactly 0)."""
    unknown = models.unwritable_characters(tokenizer, [t for pair in pairs for t in pair_texts(pair)])
    if not unknown:
        return
    bad = next(pair for pair in pairs if any(not unknown.isdisjoint(t) for t in pair_texts(pair)))
    char = next(c for t in pair_texts(bad) for c in t if c in unknown)
    count = sum(any(not unknown.isdisjoint(t) for t in pair_texts(pair)) for pair in pairs)
    advice = (
        "use a hub model with --model" if model_name in models.TINY_MODELS else "use a model whose tokenizer has them"
    )
    raise UsageError(
        f"{bad['where']}: {char!r} is a character the tokenizer of {model_name!r} does not know ({count} of the "
        f"{len(pairs)} pairs hold such characters, {len(unknown)} distinct), so it would read <unk>: {advice}, or "
        "remove them from the pairs"
    )


def check_lengths(tokenizer, pairs, config, model_name):
    """Refuse a pair whose prompt and chosen or rejected completion, as the reward model reads them (models.
    reward_texts), overflow the positions of `config`; a text of more characters than the positions could hold
    (positions times the longest token) is refused before it is tokenized, and only texts that may overflow (more
    UTF-8 bytes than positions) are tokenized at all."""
    limit = getattr(config, "max_position_embeddings", None)
    if not limit:
        return
    halves = [(pair, key) for pair in pairs for key in ("chosen", "rejected")]
    size = lambda value: sum(map(len, value if isinstance(value, str) else [m["content"] for m in value]))
    chars = [size(pair["prompt"]) + size(pair[key]) for pair, key in halves]
    longest_token = max(map(len, tokenizer.get_vocab()))
    for (pair, key), n in zip(halves, chars):
        if n > limit * longest_token:
            too_long(pair, key, f"{n} characters", limit, model_name)
    texts, templated = learnt_reward.reward_texts(tokenizer, [""], [""])
    overhead = len(tokenizer(texts, add_special_tokens=not templated)["input_ids"][0]) + 8  # the template's tokens
    maybe = [(pair, key) for (pair, key), n in zip(halves, chars) if 4 * n + overhead > limit]  # <= 4 bytes a char
    for start in range(0, len(maybe), 256):  # a bounded amount a call: a signal is handled between calls
        part = maybe[start : start + 256]
        texts, templated = learnt_reward.reward_texts(
            tokenizer, [p["prompt"] for p, _ in part], [p[k] for p, k in part]
        )
        for (pair, key), ids in zip(part, tokenizer(texts, add_special_tokens=not templated)["input_ids"]):
            if len(ids) > limit:
                too_long(pair, key, f"{len(ids)} tokens", limit, model_name)


def too_long(pair, key, size, limit, model_name):
    raise UsageError(
        f"{pair.get('where', 'a synthetic pair')}: its prompt and {key} completion are {size} as the reward model "
        f"reads them, more than the {limit} positions of {model_name!r}: shorten or drop it"
    )


def shortest_pair(tokenizer, prompts, sample=256):
    """About the fewest tokens a pair's text has as the reward model reads it: the fewest of the `sample`
    prompts shortest in characters, rendered with an empty completion (the memory bound's length)."""
    shortest = sorted(prompts, key=lambda p: len(json.dumps(p)))[:sample]
    texts, templated = learnt_reward.reward_texts(
        tokenizer, shortest, [[] if isinstance(p, list) else "" for p in shortest]
    )
    return max(1, min(len(ids) for ids in tokenizer(texts, add_special_tokens=not templated)["input_ids"]))
