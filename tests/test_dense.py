"""Dense rewards: a reward function's per-token values or (start, end, value) spans land on the tokens that
earned them (whatever the padding, even when a byte-level tokenizer splits a character across tokens), PPO adds
them to its per-token reward before GAE, GRPO takes their sum as the outcome, and bad ones get one-line errors."""

import importlib.util
import math
import os
import random

import pytest
import torch
from safetensors.torch import load_file

import common
import grpo
import ppo
from machinery import generation, models, scoring
from machinery.errors import UsageError
from machinery.tiny_model import TINY_MODEL
from tasks import Task, load_task
from tasks.rewards import copy_dense_reward, copy_reward


def byte_tokenizer():
    """benchmarks/bench.py's: every UTF-8 byte one token, so "é" (2 bytes) is split across two tokens."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench.py")
    spec = importlib.util.spec_from_file_location("bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.byte_tokenizer()


def task_of(reward_fn):
    return Task("t", [], [], reward_fn)


def batch(tokenizer, completions, eos=True, pad_left=0):
    """completion_ids, completion_mask [B, T] as the scripts hold them: each completion's tokens, its EOS, then
    padding; with pad_left, that many padding positions first (the mask says where the real tokens are)."""
    rows = [tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * eos for c in completions]
    T = pad_left + max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * pad_left + r + [pad] * (T - pad_left - len(r)) for r in rows])
    mask = torch.tensor([[0] * pad_left + [1] * len(r) + [0] * (T - pad_left - len(r)) for r in rows])
    return ids, mask


def score(tokenizer, reward_fn, completions, **kw):
    ids, mask = batch(tokenizer, completions, **kw)
    n = len(completions)
    return scoring.score_tokens(task_of(reward_fn), tokenizer, ["p="] * n, completions, ["a"] * n, ids, mask), mask


@pytest.mark.exact
def test_spans_land_on_the_token_that_writes_their_last_character(tiny_tokenizer):
    spans = lambda p, c, a: [s for s in [(0, 1, 0.5), (1, 3, 2.0), (4, 5, -1.0)] if s[1] <= len(c)]
    placed, mask = score(tiny_tokenizer, spans, ["12345", "98765"])  # one character a token, then EOS
    expected = torch.tensor([0.5, 0.0, 2.0, 0.0, -1.0, 0.0])  # chars 1-2 end at token 2; token 5 is the EOS
    assert torch.equal(placed, torch.stack([expected, expected]))


@pytest.mark.exact
@pytest.mark.parametrize("pad_left", [0, 3])
def test_per_token_values_and_outcomes_follow_the_real_tokens(tiny_tokenizer, pad_left):
    def reward(prompt, completion, answer):
        return [float(i + 1) for i in range(len(completion) + 1)] if completion != "7" else 0.25  # EOS included

    placed, mask = score(tiny_tokenizer, reward, ["123", "7", "45"], pad_left=pad_left)
    P = pad_left
    expected = torch.zeros(3, P + 4)
    expected[0, P : P + 4] = torch.tensor([1.0, 2, 3, 4])
    expected[1, P + 1] = 0.25  # an outcome score: on the last real token, the EOS
    expected[2, P : P + 3] = torch.tensor([1.0, 2, 3])
    assert torch.equal(placed, expected)
    assert torch.equal(placed * (1 - mask), torch.zeros_like(placed))  # nothing on padding


@pytest.mark.exact
@pytest.mark.parametrize("pad_left", [0, 2])
def test_a_character_split_across_tokens_is_credited_to_the_token_that_completes_it(pad_left):
    tokenizer = byte_tokenizer()
    text = "aé1"  # a: 1 byte, é: 2 bytes, 1: 1 byte -> 4 tokens, then EOS
    ids, mask = batch(tokenizer, [text], pad_left=pad_left)
    real_ids = ids[0][mask[0].bool()].tolist()
    assert len(real_ids) == 5
    assert scoring.token_ends(tokenizer, real_ids, text) == [1, 1, 2, 3, 3]

    seen = {}

    def reward(prompt, completion, answer, tokens):
        seen.setdefault("tokens", tokens)  # the completion's (its prefixes follow, for the causality check)
        return [s for s in [(1, 2, 0.5), (2, 3, 0.25), (0, 3, 1.0)] if s[1] <= len(completion)]

    placed = scoring.score_tokens(task_of(reward), tokenizer, ["p"], [text], ["a"], ids, mask)
    P = pad_left
    expected = torch.zeros_like(placed)
    expected[0, P + 2] = 0.5  # é is complete at its second byte's token
    expected[0, P + 3] = 0.25 + 1.0  # the character "1", and the whole text, end at token 3
    assert torch.equal(placed, expected)
    assert seen["tokens"] == ["a", "", "é", "1", ""]  # the text each token writes: nothing for é's first byte, EOS


def share_of_the_longer(prompt, completion, answer):
    """The dense copy reward as it was first written: each right character 1 / max(len(answer), len(completion))."""
    n = max(len(answer), len(completion))
    return [(i, i + 1, 1 / n) for i, (a, c) in enumerate(zip(answer, completion)) if a == c]


def test_a_dense_reward_that_is_not_causal_gets_one_line(tiny_tokenizer):
    """ "12345" for answer "1234": the 5 lowers what each right character was paid (0.25 to 0.2). The check runs on
    the longest completion, here neither the first nor the last row ("12" and "1" are paid causally)."""
    completions = ["12", "12345", "1"]
    ids, mask = batch(tiny_tokenizer, completions)
    with pytest.raises(
        UsageError,
        match=r"is not causal: on prompt '1234=', the first 1 token\(s\) of completion "
        r"'12345' were paid 0.2 in all, but it gives their text '1' 0.25",
    ) as e:
        scoring.score_tokens(
            task_of(share_of_the_longer), tiny_tokenizer, ["1234="] * 3, completions, ["1234"] * 3, ids, mask
        )
    assert "\n" not in str(e.value)
    placed = scoring.score_tokens(
        task_of(copy_dense_reward), tiny_tokenizer, ["1234="] * 3, completions, ["1234"] * 3, ids, mask
    )
    assert placed[1].tolist() == pytest.approx([0.25, 0.25, 0.25, 0.25, -0.2, 0])  # the 5 pays on its own token
    assert placed[0].tolist() == pytest.approx([0.25, 0.25, 0, 0, 0, 0])


def test_per_token_values_are_checked_on_the_prefixes_they_are_given(tiny_tokenizer):
    """A function taking `tokens` sees each prefix's tokens; paying the last token for the length is not causal."""
    causal = lambda p, c, a, tokens: [0.1 * (t == "1") for t in tokens]
    ids, mask = batch(tiny_tokenizer, ["121"])
    assert scoring.score_tokens(
        task_of(causal), tiny_tokenizer, ["p"], ["121"], ["a"], ids, mask
    ).sum() == pytest.approx(0.2)
    by_length = lambda p, c, a, tokens: [0.0] * (len(tokens) - 1) + [float(len(tokens))]
    with pytest.raises(UsageError, match="is not causal"):
        scoring.score_tokens(task_of(by_length), tiny_tokenizer, ["p"], ["121"], ["a"], ids, mask)


def paid_before_a_9(prompt, completion, answer):
    """Not causal: a character is paid 1 when the next one is a 9, so its value is known only one token later."""
    return [(i, i + 1, 1.0) for i in range(len(completion) - 1) if completion[i + 1] == "9"]


def paid_before_a_9_per_token(prompt, completion, answer, tokens):
    """paid_before_a_9 as one value a token, seeing the tokens."""
    return [float(k + 1 < len(tokens) and tokens[k + 1] == "9") for k in range(len(tokens))]


def paid_before_the_eos(prompt, completion, answer, tokens):
    """Not causal: the token before the EOS is paid 1 for stopping (the EOS itself should be)."""
    return [float(k + 1 < len(tokens) and tokens[k + 1] == "") for k in range(len(tokens))]


BOUNDARY = {
    # (reward, completion, whether it ends with an EOS, the one prefix, in tokens, whose total is wrong)
    "first prefix, spans": (paid_before_a_9, "1923", True, 1),
    "first prefix, per token": (paid_before_a_9_per_token, "1923", True, 1),
    "last prefix, spans, cut before an EOS": (paid_before_a_9, "1239", False, 3),
    "last prefix, per token, cut before an EOS": (paid_before_a_9_per_token, "1239", False, 3),
    "last prefix, paid before the EOS": (paid_before_the_eos, "123", True, 3),
}


@pytest.mark.parametrize("case", BOUNDARY)
def test_a_reward_that_is_not_causal_on_one_prefix_only_is_refused(tiny_tokenizer, case):
    """The check must call the reward on every prefix, the first (one token) and the last (all but the last
    token) included: each reward here pays every other prefix exactly what it was paid in the whole completion."""
    reward, completion, eos, wrong = BOUNDARY[case]
    tokens = list(completion) + [""] * eos  # the tiny tokenizer: one character a token; the EOS writes nothing

    sees_tokens = task_of(reward).wants_tokens
    assert sees_tokens == (reward is not paid_before_a_9)  # the spans are checked on the prefixes' texts alone

    def per_token(toks):  # a span (i, i + 1, v) is on token i: one character a token
        values = reward("p", "".join(toks), "a", **({"tokens": toks} if sees_tokens else {}))
        spans = values and isinstance(values[0], tuple)
        return [sum(v for i, _, v in values if i == k) for k in range(len(toks))] if spans else values

    whole = per_token(tokens)
    differs = [k for k in range(1, len(tokens)) if sum(per_token(tokens[:k])) != sum(whole[:k])]
    assert differs == [wrong]  # the premise: one prefix shows it, and it is the first or the last one
    assert wrong in (1, len(tokens) - 1)
    ids, mask = batch(tiny_tokenizer, [completion], eos=eos)
    with pytest.raises(UsageError, match=rf"is not causal: .* the first {wrong} token\(s\) of completion") as e:
        scoring.score_tokens(task_of(reward), tiny_tokenizer, ["p"], [completion], ["a"], ids, mask)
    assert "\n" not in str(e.value)


def test_copy_dense_reward_is_the_increase_of_copy_reward_on_each_prefix():
    """r_i = R(c[:i+1]) - R(c[:i]): it sums to copy_reward, and a later character never changes an earlier value."""
    rng = random.Random(0)
    for _ in range(500):
        answer = "".join(rng.choices("0123", k=rng.randint(1, 6)))
        completion = "".join(rng.choices("0123", k=rng.randint(0, 8)))
        values = dict((s, v) for s, _, v in copy_dense_reward("", completion, answer))
        assert math.isclose(sum(values.values()), copy_reward("", completion, answer), abs_tol=1e-12)
        for i in range(len(completion)):
            increase = copy_reward("", completion[: i + 1], answer) - copy_reward("", completion[:i], answer)
            assert math.isclose(values.get(i, 0.0), increase, abs_tol=1e-12)
            assert (values.get(i, 0) > 0) == (i < len(answer) and completion[i] == answer[i])  # paid where right
    # A character past the answer is paid, negative, on its own token; what came before it keeps its value.
    assert copy_dense_reward("", "12345", "1234") == [
        *copy_dense_reward("", "1234", "1234"),
        (4, 5, pytest.approx(-0.2)),
    ]


def test_copy_task_forms():
    assert load_task("copy").name == "copy" and len(load_task("copy").train) == 900
    task = load_task("copy:8:dense")
    assert task.name == "copy:8:dense" and len(task.train) == 9000 and task.reward_fn is copy_dense_reward
    assert all(len(ex["answer"]) == 8 and ex["prompt"] == ex["answer"] + "=" for ex in task.train[:50])
    assert load_task("copy:8").reward_fn is copy_reward and load_task("copy:8").train == task.train
    for bad in ("copy:0", "copy:x", "copy:8:sparse"):
        with pytest.raises(UsageError, match="write copy:DIGITS, copy:LOW-HIGH or either with :dense"):
            load_task(bad)


BAD = {
    "nan per token": ([1.0, float("nan")], "a dense reward is a list of finite numbers"),
    "inf span value": ([(0, 1, math.inf)], "a dense reward is a list of finite numbers"),
    "span past the end": ([(2, 9, 1.0)], r"span \(2, 9\) is not within the completion of 3 characters"),
    "empty span": ([(1, 1, 1.0)], r"span \(1, 1\) is not within"),
    "not a span": ([(0, 1)], "a dense reward is a list of finite numbers"),
    "too few per token": ([1.0, 2.0], "returned 2 per-token values on prompt '12=', whose completion has 4 tokens"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_dense_rewards_get_one_line_errors_naming_the_prompt(tiny_tokenizer, case):
    value, message = BAD[case]
    ids, mask = batch(tiny_tokenizer, ["123"])
    with pytest.raises(UsageError, match=message) as e:
        scoring.score_tokens(task_of(lambda p, c, a: value), tiny_tokenizer, ["12="], ["123"], ["12"], ids, mask)
    assert "\n" not in str(e.value) and "'12='" in str(e.value)


def dense_task(monkeypatch, fn):
    """copy:3 with `fn` as its reward, through the scripts' own load_task."""
    task = load_task("copy")
    task.reward_fn = fn
    for module in (ppo, grpo):
        monkeypatch.setattr(module, "load_task", lambda name: task)


def stored_completions(d):
    tokenizer = models.load_tokenizer(TINY_MODEL)
    completions = generation.decode_completions(
        tokenizer, d["completion_ids"], d["completion_mask"], [tokenizer.eos_token_id]
    )
    return tokenizer.batch_decode(d["prompt_ids"], skip_special_tokens=True), completions


def test_grpo_outcome_is_the_sum_of_the_dense_reward(tmp_path, monkeypatch):
    dense_task(monkeypatch, lambda p, c, a: [(i, i + 1, 0.1 * (i + 1)) for i in range(len(c)) if c[i] in "0123456"])
    dump = tmp_path / "dump"
    grpo.main(
        grpo.Args(
            num_steps=1,
            prompts_per_step=4,
            group_size=4,
            sample_every=0,
            output_dir=str(tmp_path / "r"),
            dump_dir=str(dump),
        )
    )
    d = load_file(dump / "step000001.safetensors")
    _, completions = stored_completions(d)
    expected = [sum(0.1 * (i + 1) for i, ch in enumerate(c) if ch in "0123456") for c in completions]
    assert d["rewards"].tolist() == pytest.approx(expected, abs=1e-6)
    assert len(set(expected)) > 1  # the completions differ, so a wrong sum could not pass


@pytest.mark.exact
def test_ppo_reward_holds_each_value_at_its_token(tmp_path, monkeypatch):
    """With no KL penalty and no missing-EOS penalty, PPO's per-token reward is the dense reward itself."""
    dense_task(
        monkeypatch, lambda p, c, a: [(i, i + 1, float(i + 1)) for i in range(len(c)) if i < len(p) and c[i] == p[i]]
    )
    dump = tmp_path / "dump"
    ppo.main(
        ppo.Args(
            num_steps=1,
            prompts_per_step=16,
            kl_coef=0.0,
            missing_eos_penalty=0.0,
            sample_every=0,
            output_dir=str(tmp_path / "r"),
            dump_dir=str(dump),
        )
    )
    d = load_file(dump / "step000001.safetensors")
    prompts, completions = stored_completions(d)
    tokenizer = models.load_tokenizer(TINY_MODEL)
    expected = torch.zeros_like(d["rewards"])
    for row, (p, c) in enumerate(zip(prompts, completions)):
        # Which token writes each character: decode the tokens one by one (a sampled <pad> writes 5 characters).
        owner = [
            k
            for k, token in enumerate(d["completion_ids"][row].tolist())
            for _ in tokenizer.decode([token], skip_special_tokens=False)
        ][: len(c)]
        for i in range(len(c)):
            if i < len(p) and c[i] == p[i]:
                expected[row, owner[i]] += float(i + 1)
    assert torch.equal(d["rewards"], expected)
    assert torch.equal(d["scores"], expected.sum(1))
    assert expected.count_nonzero() > 0  # some character was right, so the test sees a placement


def test_evaluate_counts_a_dense_reward_as_its_total(tiny_model, tiny_tokenizer):
    eos = [tiny_tokenizer.eos_token_id]
    outcome = common.evaluate(tiny_model, tiny_tokenizer, load_task("copy:3"), 5, eos, True, num_examples=40)
    dense = common.evaluate(tiny_model, tiny_tokenizer, load_task("copy:3:dense"), 5, eos, True, num_examples=40)
    assert dense == pytest.approx(outcome, abs=1e-6) and outcome["eval/reward"] > 0  # some characters right
