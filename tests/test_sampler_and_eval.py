"""Code no test used to call: the prompt sampler, the held-out evaluation (direct and inside a run), and the
copy task's held-out split scored by a constant answer. Expected values are computed here, independently."""

import os
import random

import pytest
import torch
from conftest import make_small_model

import common
import grpo
import ppo
import tasks
from machinery import batches, state_file

EOS = 1


# ---------------------------------------------------------------------------------------------------
# PromptSampler: endless shuffled passes, seeded, resumable.
# ---------------------------------------------------------------------------------------------------

EXAMPLES = [{"prompt": f"{i}=", "answer": str(i)} for i in range(10)]


def draws(sampler, sizes):
    return [ex["prompt"] for n in sizes for ex in sampler.sample(n)]


def test_sampler_gives_each_example_once_per_pass():
    """Guards against sampling with replacement, or an example left in (or dropped from) the order:
    every 10 consecutive draws, whatever the batch sizes, are the 10 examples."""
    sampler = batches.PromptSampler(EXAMPLES, seed=3)
    seq = draws(sampler, [3, 4, 1, 7, 5, 10])  # 30 draws across batch boundaries
    passes = [seq[i : i + 10] for i in range(0, 30, 10)]
    for p in passes:
        assert sorted(p) == sorted(ex["prompt"] for ex in EXAMPLES)
    assert len({tuple(p) for p in passes}) == 3, "each pass must be shuffled anew"
    assert passes[0] != sorted(passes[0]) and passes[0] != [ex["prompt"] for ex in EXAMPLES]


def test_sampler_order_depends_on_its_seed_only():
    """Guards against a sampler that ignores its seed, or shuffles with the global `random` (then another
    draw from it, e.g. by a reward function, changes the prompts a run sees)."""
    a = draws(batches.PromptSampler(EXAMPLES, seed=1), [10, 10])
    random.seed(12345)
    other = batches.PromptSampler(EXAMPLES, seed=1)
    first = draws(other, [5])
    random.random()
    random.shuffle(list(range(100)))
    assert first + draws(other, [5, 10]) == a
    assert draws(batches.PromptSampler(EXAMPLES, seed=2), [10, 10]) != a


def test_sampler_state_round_trip_continues_the_same_sequence():
    """Guards against a state that is not restored (order or RNG), or one that aliases the live order and so
    moves on after it was saved. Saved mid-pass, in the checkpoint's format (state_file.py), and loaded into a
    sampler of another seed, it continues exactly; the continuation crosses into the next pass (the RNG)."""
    sampler = batches.PromptSampler(EXAMPLES, seed=7)
    draws(sampler, [4, 3])  # 7 draws: mid-pass
    state = sampler.state_dict()
    saved = state_file.state_bytes(state)
    expected = draws(sampler, [6, 10, 5])  # finishes this pass, then two more shuffles
    for loaded in (state_file.parse_state(saved), state):  # `state` itself must not have moved on with the sampler
        resumed = batches.PromptSampler(EXAMPLES, seed=99)
        resumed.load_state_dict(loaded)
        assert draws(resumed, [6, 10, 5]) == expected


# ---------------------------------------------------------------------------------------------------
# common.evaluate: greedy completions on the held-out split.
# ---------------------------------------------------------------------------------------------------


def strip_specials(text):
    return text.replace("<pad>", "").replace("<unk>", "")


def greedy_texts(model, tokenizer, prompts, max_new_tokens):
    """Greedy decoding one prompt at a time, no padding, no cache: argmax of the last position's logits.
    Also returns the smallest gap between the best and second-best logit, so a near-tie cannot decide a test."""
    texts, gap = [], float("inf")
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out = []
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
                top2 = logits.topk(2).values
                gap = min(gap, float(top2[0] - top2[1]))
                out.append(int(logits.argmax()))
                if out[-1] == EOS:
                    break
        texts.append(strip_specials("".join(tokenizer.convert_ids_to_tokens([t for t in out if t != EOS]))))
    return texts, gap


def position_match(prompt, completion, answer):
    """Share of characters in the right place (special-token text removed), over the longer of the two."""
    completion = strip_specials(completion)
    longest = max(len(answer), len(completion), 1)
    return sum(a == c for a, c in zip(answer, completion)) / longest


def test_evaluate_scores_greedy_completions_of_the_held_out_split(tiny_tokenizer):
    """Guards against evaluating the training split, dropping rows between batches, sampling instead of
    greedy decoding, an accuracy that counts partial credit, or a mean over the wrong count. The answers are
    built from greedy completions computed here: a third exact (reward 1), a third with one character changed
    (partial credit), a third wrong; 130 of 150 held-out examples, in batches of 64, 64 and 2."""
    model = make_small_model(vocab_size=25, seed=2)
    prompts = [f"{i}+{j}=" for i in range(15) for j in range(10)]
    texts, gap = greedy_texts(model, tiny_tokenizer, prompts[:130], 6)
    assert gap > 1e-3  # sharp logits: no tie for the batched forward to break differently
    test = []
    for i, (prompt, text) in enumerate(zip(prompts, texts + [""] * 20)):
        if i % 3 == 0:
            answer = text
        elif i % 3 == 1:
            answer = text[:-1] + ("9" if text[-1:] != "9" else "8") if text else "7"
        else:
            answer = "+" * 7
        test.append({"prompt": prompt, "answer": answer})
    train = [{"prompt": "9=", "answer": "9"}] * 5  # never the held-out split
    task = tasks.Task("made-up", train, test, position_match)
    torch.manual_seed(0)
    metrics = common.evaluate(model, tiny_tokenizer, task, 6, [EOS], chat_template=True, num_examples=130)
    rewards = [position_match(ex["prompt"], text, ex["answer"]) for ex, text in zip(test, texts)]
    assert metrics["eval/accuracy"] == pytest.approx(sum(r == 1 for r in rewards) / 130)
    assert metrics["eval/reward"] == pytest.approx(sum(rewards) / 130)
    assert 0 < sum(0 < r < 1 for r in rewards) and metrics["eval/accuracy"] < metrics["eval/reward"] < 1


@pytest.fixture(scope="module")
def sharp_folder(tmp_path_factory, tiny_tokenizer):
    folder = tmp_path_factory.mktemp("sharp-eval")
    make_small_model(vocab_size=25, seed=2).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return str(folder)


SCRIPTS = {"grpo": grpo, "ppo": ppo}


EVAL_TASK = '''
EXAMPLES = [{"prompt": f"{a}*{b}=", "answer": str(a * b + 11)} for a in range(0, 200, 20) for b in range(10)]


def reward(prompt, completion, answer):
    """Varies with the completion and the answer; special tokens shown in the text or not give the same."""
    text = completion.replace("<pad>", "").replace("<unk>", "")
    return ((sum(map(ord, text)) + 3 * int(answer)) % 11) / 10
'''
EVAL_NAMESPACE = {}
exec(EVAL_TASK, EVAL_NAMESPACE)


@pytest.mark.parametrize("script", SCRIPTS)
def test_eval_every_logs_the_trained_policys_held_out_score(script, sharp_folder, tiny_tokenizer, tmp_path):
    """--eval-every 2 on a 2-step run: eval/ is logged at step 2 only, and is the greedy evaluation of the
    policy after step 2's update (the saved final model) on the held-out split (10 of 100 examples, partial
    credit). Guards against evaluating the reference or the pre-update policy, the training split, or at the
    wrong step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    (tmp_path / "eval_task.py").write_text(EVAL_TASK)
    name = f"python:{tmp_path / 'eval_task.py'}:reward"
    fields = dict(
        model=sharp_folder,
        preset="tiny",
        task=name,
        seed=2,
        num_steps=2,
        prompts_per_step=4,
        max_new_tokens=4,
        learning_rate=3e-2,
        eval_every=2,
        sample_every=0,
        output_dir=str(tmp_path / "runs"),
    )
    fields.update(group_size=4, beta=0.1) if script == "grpo" else fields.update(kl_coef=0.1, num_minibatches=1)
    SCRIPTS[script].main(SCRIPTS[script].Args(**fields))
    (run_dir,) = [os.path.join(tmp_path, "runs", d) for d in os.listdir(tmp_path / "runs")]
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in ("eval/accuracy", "eval/reward")}
    assert all(list(steps) == [2] for steps in logged.values())

    task = tasks.load_task(name)
    final = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "final"))
    prompts = [ex["prompt"] for ex in task.test]
    texts, gap = greedy_texts(final, tiny_tokenizer, prompts, 4)
    assert gap > 1e-3
    varied = EVAL_NAMESPACE["reward"]
    rewards = [varied(p, text, ex["answer"]) for p, text, ex in zip(prompts, texts, task.test)]
    assert logged["eval/accuracy"][2] == pytest.approx(sum(r == 1 for r in rewards) / len(rewards))
    assert logged["eval/reward"][2] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
    # The check can fail: the training split, and the model before the updates, score otherwise.
    train_texts = greedy_texts(final, tiny_tokenizer, [ex["prompt"] for ex in task.train], 4)[0]
    on_train = [varied("", t, ex["answer"]) for ex, t in zip(task.train, train_texts)]
    initial = greedy_texts(AutoModelForCausalLM.from_pretrained(sharp_folder), tiny_tokenizer, prompts, 4)[0]
    before = [varied("", t, ex["answer"]) for ex, t in zip(task.test, initial)]
    for other in (on_train, before):
        assert abs(sum(other) / len(other) - logged["eval/reward"][2]) > 1e-4


# ---------------------------------------------------------------------------------------------------
# The copy task: no constant answer pays.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("constant", ["000", "123", "555", "999", "0", "0000000"])
def test_a_constant_answer_earns_little_on_the_held_out_split(constant):
    """The copy reward's promise (rewards.copy_reward): a constant completion gets about 0.1 per digit, never
    enough to trap the policy. Guards against an unshuffled split (held out = 000..099, where "000" earns
    1/3 and more), and against a denominator that lets a longer constant earn more."""
    task = tasks.copy_task()
    answers = [ex["answer"] for ex in task.test]
    expected = sum(sum(a == c for a, c in zip(answer, constant)) / max(3, len(constant)) for answer in answers) / 100
    score = sum(task.score([ex["prompt"] for ex in task.test], [constant] * 100, answers)) / 100
    assert score == pytest.approx(expected)
    assert score < 0.2
    for position in range(3):  # the held-out digits are spread out, as a shuffle gives
        assert len({answer[position] for answer in answers}) == 10
