"""reward_model.py: the Bradley-Terry loss (by hand and against TRL's RewardTrainer), the score at the last real token,
the same score through ppo.py's --reward-model (each text of a padded batch as if alone, in training and in use),
micro-batches against the whole batch (training and held-out), the preference data's rules (no pair of equal gold
rewards, a prompt's pairs on one side of the split) and its bad input, resume, and that it learns."""

import collections
import itertools
import json
import math
import os
import random

import pytest
import torch
from safetensors.torch import load_file
from test_exactness import bos_tokenizer

import grpo
import ppo
import reward_model
from machinery import batches, generation, learnt_reward, models
from machinery.errors import UsageError
from machinery.tiny_model import TINY_MODEL
from tasks import copy_task, preferences
from tasks.rewards import graded_copy_reward

CPU = torch.device("cpu")
SMALL = dict(num_pairs=128, num_steps=4, batch_size=16, micro_batch_size=8, eval_every=0)


def run(tmp_path, **overrides):
    """reward_model.main on the tiny model; returns (held-out evaluation, the run's folder). --num-pairs only on the
    synthetic task: with a file of pairs it cannot act, and is refused."""
    small = {k: v for k, v in SMALL.items() if k != "num_pairs" or overrides.get("task", "synthetic") == "synthetic"}
    args = reward_model.Args(**dict(small, output_dir=str(tmp_path), **overrides))
    evaluation = reward_model.main(args)
    (folder,) = [os.path.join(tmp_path, d) for d in os.listdir(tmp_path) if os.path.isdir(os.path.join(tmp_path, d))]
    return evaluation, folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A reward model trained for 20 steps on the synthetic task: its final folder."""
    _, folder = run(tmp_path_factory.mktemp("rm"), num_pairs=256, num_steps=20)
    return os.path.join(folder, "final")


# ---------------------------------------------------------------------------------------------------
# The loss, and the score.
# ---------------------------------------------------------------------------------------------------


def test_bradley_terry_loss_by_hand_and_over_micro_batches():
    chosen, rejected = torch.tensor([1.0, -0.5, 2.0, 0.0]), torch.tensor([0.0, 0.5, -1.0, 3.0])
    by_hand = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 4
    assert reward_model.bradley_terry_loss(chosen, rejected, 4).item() == pytest.approx(by_hand, rel=1e-6)
    halves = sum(reward_model.bradley_terry_loss(chosen[s], rejected[s], 4) for s in (slice(0, 1), slice(1, 4)))
    assert halves.item() == pytest.approx(by_hand, rel=1e-6)
    assert reward_model.bradley_terry_loss(torch.tensor([50.0]), torch.tensor([-50.0]), 1).item() < 1e-20
    assert reward_model.bradley_terry_loss(torch.tensor([-50.0]), torch.tensor([50.0]), 1).item() == pytest.approx(100)


def tiny_pairs():
    return [
        {"prompt": "123=", "chosen": "123", "rejected": "9"},
        {"prompt": "45=", "chosen": "44", "rejected": "(((((("},
        {"prompt": "7=", "chosen": "7<pad>", "rejected": "70"},  # a pad written inside the text
    ]


def test_the_loss_equals_trls_reward_trainer(trained, tmp_path):
    """TRL's RewardTrainer.compute_loss on the same pairs, tokenised as reward_model.py reads them, the same weights."""
    trl = pytest.importorskip("trl", reason="trl is optional: pip install -r requirements/extra.txt")
    from datasets import Dataset
    from trl.trainer.reward_trainer import DataCollatorForPreference

    tokenizer = models.load_tokenizer(trained)
    model = reward_model.load_reward_model(trained, CPU).eval()
    pairs = tiny_pairs()
    with torch.no_grad():
        ours = reward_model.bradley_terry_loss(*reward_model.pair_rewards(model, tokenizer, pairs, CPU), len(pairs))
    ids = lambda key: [tokenizer(p["prompt"] + p[key])["input_ids"] for p in pairs]  # noqa: E731
    rows = [{"chosen_ids": c, "rejected_ids": r} for c, r in zip(ids("chosen"), ids("rejected"))]
    config = trl.RewardConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_length=None)
    trainer = trl.RewardTrainer(
        model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    inputs = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)(rows)
    model.eval()
    with torch.no_grad():
        theirs = trainer.compute_loss(model, inputs)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7)
    assert ours.item() > 0.01  # a loss with something in it, not two zeros


def test_the_score_is_the_scalar_head_at_the_last_real_token(trained):
    """pair_rewards against the head applied by hand to the backbone's hidden state at each text's last token that is
    not the pad id, one text at a time (no padding)."""
    tokenizer = models.load_tokenizer(trained)
    model = reward_model.load_reward_model(trained, CPU).eval()
    pairs = tiny_pairs()
    with torch.no_grad():
        chosen, rejected = reward_model.pair_rewards(model, tokenizer, pairs, CPU)
        for pair, c, r in zip(pairs, chosen.tolist(), rejected.tolist()):
            for completion, score in ((pair["chosen"], c), (pair["rejected"], r)):
                ids = torch.tensor([tokenizer(pair["prompt"] + completion)["input_ids"]])
                last = max(i for i, t in enumerate(ids[0].tolist()) if t != tokenizer.pad_token_id)
                hidden = model.model(input_ids=ids).last_hidden_state[0, last]
                assert score == pytest.approx((model.score.weight @ hidden).item(), abs=1e-5)
    assert len(set(chosen.tolist() + rejected.tolist())) == 6


def test_the_saved_model_loads_and_scores_the_same_through_ppos_reward_model(trained):
    from transformers import AutoModelForSequenceClassification

    loaded = AutoModelForSequenceClassification.from_pretrained(trained)
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id is not None
    pairs = tiny_pairs()
    scorer = learnt_reward.RewardModel(trained, CPU, torch.float32, batch_size=2)  # what --reward-model loads
    prompts = [p["prompt"] for p in pairs]
    theirs = scorer.score(prompts * 2, [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs], [""] * 6)
    with torch.no_grad():
        ours = torch.cat(
            reward_model.pair_rewards(reward_model.load_reward_model(trained, CPU), scorer.tokenizer, pairs, CPU)
        )
    assert ours.tolist() == pytest.approx(theirs, abs=1e-6)


def absolute_position_reward_model(folder):
    """A random GPT-2 reward model (absolute positions, a wide init) on the tiny tokenizer, saved in `folder`: a
    row padded on its left reads its tokens at other positions and scores differently, which rotary positions
    (the tiny model's) would hide."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    tokenizer = models.load_tokenizer(TINY_MODEL)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.5, num_labels=1
    )
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    GPT2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_training_and_scoring_read_each_text_as_it_is_scored_alone(tmp_path):
    """Texts of different lengths in one batch, through reward_model.py's pair_rewards (training) and through
    --reward-model's RewardModel.score (use): each score is that of its text scored alone, unpadded. A row padded
    on the other side (the tokenizer's own, left) moves its tokens' positions."""
    folder = absolute_position_reward_model(tmp_path / "gpt2")
    pairs = [
        {"prompt": "1=", "chosen": "1", "rejected": "123456"},
        {"prompt": "12345=", "chosen": "12345", "rejected": "9"},
        {"prompt": "7=", "chosen": "70", "rejected": "7"},
    ]
    prompts, completions = (
        [p["prompt"] for p in pairs] * 2,
        [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs],
    )
    model, tokenizer = reward_model.load_reward_model(folder, CPU).eval(), models.load_tokenizer(folder)
    with torch.no_grad():
        alone = [
            model(**learnt_reward.reward_inputs(tokenizer, [p], [c])).logits[0, 0].item()
            for p, c in zip(prompts, completions)
        ]
        trained_on = torch.cat(reward_model.pair_rewards(model, tokenizer, pairs, CPU)).tolist()
    scored = learnt_reward.RewardModel(folder, CPU, torch.float32, batch_size=4).score(
        prompts, completions, [""] * 6
    )  # 4 + 2
    assert trained_on == pytest.approx(alone, abs=1e-5) and scored == pytest.approx(alone, abs=1e-5)
    assert max(alone) - min(alone) > 0.1  # scores far apart: a padded row that moved would show


def test_held_out_evaluation_in_micro_batches_is_the_whole_sets(tmp_path):
    """evaluate over micro-batches of 2 (2 + 2 + 1 pairs) gives the accuracy, mean margin and mean loss of the 5
    held-out pairs scored at once, against the formulas written out here."""
    folder = absolute_position_reward_model(tmp_path / "gpt2")
    model, tokenizer = reward_model.load_reward_model(folder, CPU).eval(), models.load_tokenizer(folder)
    pairs = [{"prompt": f"{i}=", "chosen": f"{i}" * (i % 3 + 1), "rejected": f"{9 - i}"} for i in range(5)]
    with torch.no_grad():
        chosen, rejected = reward_model.pair_rewards(model, tokenizer, pairs, CPU)
    margins = (chosen - rejected).tolist()
    scores = reward_model.evaluate(model, tokenizer, pairs, 2, CPU, torch.float32)
    assert 0 < sum(m > 0 for m in margins) < 5  # some right, some wrong: an accuracy with something in it
    assert scores["eval/accuracy"] == pytest.approx(sum(m > 0 for m in margins) / 5)
    assert scores["eval/margin"] == pytest.approx(sum(margins) / 5, abs=1e-5)
    by_hand = sum(math.log(1 + math.exp(-m)) for m in margins) / 5
    assert scores["eval/bt_loss"] == pytest.approx(by_hand, abs=1e-5)


def test_ppo_and_grpo_run_on_the_saved_model(trained, tmp_path):
    common = dict(reward_model=trained, num_steps=2, sample_every=0, output_dir=str(tmp_path))
    for scores in (
        ppo.main(ppo.Args(prompts_per_step=8, **common)),
        grpo.main(grpo.Args(prompts_per_step=2, **common)),
    ):
        assert len(scores) == 2 and all(math.isfinite(s) for s in scores)
        assert not set(scores) <= {0.0, 1.0 / 3, 2.0 / 3, 1.0}  # the reward model's scores, not copy_reward's


def first_step_scalars(folder, *names):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    return [events.Scalars(name)[0].value for name in names]


@pytest.mark.parametrize("micro_batch_size", [6, 5])
def test_micro_batches_give_the_whole_batchs_loss_and_gradient(tmp_path, micro_batch_size):
    """A batch of 12 pairs in micro-batches of 6 + 6 or 5 + 5 + 2 against the whole batch at once: the same logged
    loss and gradient norm at step 1 (each micro-batch's loss is its share of the batch's mean, not its own mean)."""
    path = write_pairs(tmp_path, good_rows(40))
    flags = dict(task=f"jsonl:{path}", num_steps=1, batch_size=12, eval_every=0)
    whole = run(tmp_path / "whole", micro_batch_size=12, **flags)[1]
    split = run(tmp_path / "split", micro_batch_size=micro_batch_size, **flags)[1]
    names = ("losses/bt_loss", "losses/grad_norm")
    assert first_step_scalars(split, *names) == pytest.approx(first_step_scalars(whole, *names), rel=1e-4)


def test_reward_texts_of_a_conversation_and_of_strings_are_one_text():
    """A conversational pair renders as RewardModel renders a string prompt and completion (user, then assistant)."""
    tokenizer = bos_tokenizer()
    strings, templated = learnt_reward.reward_texts(tokenizer, ["what is 2+2?"], ["4"])
    messages, _ = learnt_reward.reward_texts(
        tokenizer, [[{"role": "user", "content": "what is 2+2?"}]], [[{"role": "assistant", "content": "4"}]]
    )
    assert templated and strings == messages == ["<s>[user] what is 2+2?\n[assistant] 4\n"]
    tiny = models.load_tokenizer(TINY_MODEL)
    assert learnt_reward.reward_texts(tiny, ["12="], ["12"]) == (["12=12"], False)
    with pytest.raises(UsageError, match="need a tokenizer with a chat template"):
        learnt_reward.reward_texts(
            tiny, [[{"role": "user", "content": "1="}]], [[{"role": "assistant", "content": "1"}]]
        )


# ---------------------------------------------------------------------------------------------------
# The data: the synthetic task's labeller, and your JSONL pairs.
# ---------------------------------------------------------------------------------------------------


def test_the_gold_reward_and_the_bradley_terry_labeller():
    assert graded_copy_reward("123=", "123", "123") == 1.0
    assert graded_copy_reward("123=", "124", "123") == pytest.approx((1 + 1 + 8 / 9) / 3)
    assert graded_copy_reward("123=", "1x3==", "123") == pytest.approx(2 / 5)
    assert graded_copy_reward("1=", "", "1") == 0.0
    assert preferences.preference_probability(0.7, 0.5, 30) == pytest.approx(1 / (1 + math.exp(-6)))
    assert preferences.preference_probability(0.5, 0.5, 30) == 0.5
    # Two fixed completions, gold 1 and 8/9 of 1: the better one is chosen sigmoid(beta / 27) of the time.
    calls = itertools.cycle(["123", "124"])  # the first sample of every prompt, then the second
    sample = lambda prompts: [next(calls)] * len(prompts)  # noqa: E731
    pairs = preferences.synthetic_pairs(sample, [{"prompt": "123=", "answer": "123"}], 4000, 30.0, seed=0, batch=100)
    share = sum(p["chosen"] == "123" for p in pairs) / len(pairs)
    expected = 1 / (1 + math.exp(-30 * (1 - (26 / 27))))
    assert abs(share - expected) < 4 * math.sqrt(expected * (1 - expected) / len(pairs))
    assert all(p["gold_chosen"] == graded_copy_reward("123=", p["chosen"], "123") for p in pairs)


def test_no_labelled_pair_has_two_equal_gold_rewards():
    """Completions that differ but earn the same gold reward ("122" and "124" for "123", one place off by 1 each)
    are drawn again like equal ones: no labeller could prefer either, so a coin-flip label would get in. So is a
    pair with an empty completion."""
    rng = random.Random(0)
    sample = lambda prompts: [rng.choice(["122", "124", "123", "133", ""]) for _ in prompts]  # noqa: E731
    pairs = preferences.synthetic_pairs(sample, [{"prompt": "123=", "answer": "123"}], 300, 30.0, seed=0, batch=50)
    assert len(pairs) == 300 and all(p["gold_chosen"] != p["gold_rejected"] for p in pairs)
    assert all(p["chosen"] and p["rejected"] for p in pairs)  # an empty completion is drawn again too
    for p in pairs:
        assert [graded_copy_reward("123=", p[k], "123") for k in ("chosen", "rejected")] == [
            p["gold_chosen"],
            p["gold_rejected"],
        ]


def test_synthetic_held_out_pairs_are_on_the_held_out_prompts():
    """The synthetic task's held-out pairs (a tenth as many) are drawn on the copy task's held-out prompts, which
    its training pairs never use."""
    rng = random.Random(0)
    sample = lambda prompts: ["".join(rng.choices("0123456789", k=rng.randint(1, 4))) for _ in prompts]  # noqa: E731
    train, test = preferences.load_pairs("synthetic", sample, 60, 30.0, seed=0)
    held_out = {example["prompt"] for example in copy_task().test}
    assert len(train) == 60 and len(test) == 6
    assert {p["prompt"] for p in test} <= held_out and not {p["prompt"] for p in train} & held_out


def test_a_policy_that_writes_nothing_new_is_refused():
    sample = lambda prompts: ["5"] * len(prompts)  # noqa: E731  every pair equal
    with pytest.raises(UsageError, match="usable pairs"):
        preferences.synthetic_pairs(sample, [{"prompt": "1=", "answer": "1"}], 10, 30.0, seed=0, batch=4, max_rounds=3)


def recording_run(tmp_path, monkeypatch, **overrides):
    """run() on pairs of texts of different lengths (so a micro-batch has padding), recording each log_step's
    (step, logged learning rate, total tokens), each step's sampled pairs, and the model trained."""
    rows = [
        {"prompt": f"{i}=", "chosen": f"{i}" * (1 + i % 4), "rejected": f"{i + 1}" * (1 + i % 3)} for i in range(40)
    ]
    logged, sampled, loaded = [], [], []
    log_step, sample, load = (
        reward_model.bookkeeping.log_step,
        batches.PromptSampler.sample,
        reward_model.load_reward_model,
    )

    def recording_log_step(writer, step, scalars, losses, timer, total_tokens, device):
        logged.append((step, scalars["charts/learning_rate"], total_tokens))
        return log_step(writer, step, scalars, losses, timer, total_tokens, device)

    monkeypatch.setattr(reward_model.bookkeeping, "log_step", recording_log_step)
    monkeypatch.setattr(batches.PromptSampler, "sample", lambda self, n: sampled.append(sample(self, n)) or sampled[-1])
    monkeypatch.setattr(
        reward_model, "load_reward_model", lambda name, device: loaded.append(load(name, device)) or loaded[-1]
    )
    flags = dict(task=f"jsonl:{write_pairs(tmp_path, rows)}", batch_size=6, micro_batch_size=4, **overrides)
    run(tmp_path / "runs", **flags)
    return logged, sampled, loaded[0]


def test_the_logged_rate_is_the_one_each_step_used_and_tokens_leave_out_padding(tmp_path, monkeypatch):
    """Under a warmup of 3 steps (not the default 0, under which every step's rate is the same) step k logs
    lr * k / 4, the rate its update used; perf/tokens_per_second counts each text's own tokens, not the padding
    of the micro-batch it shared (6 pairs a step in micro-batches of 4 + 2, texts of 3 to 6 tokens)."""
    logged, sampled, _ = recording_run(tmp_path, monkeypatch, num_steps=4, warmup_steps=3, learning_rate=1e-3)
    assert [step for step, _, _ in logged] == [1, 2, 3, 4]
    assert [rate for _, rate, _ in logged] == pytest.approx([1e-3 / 4, 2e-3 / 4, 3e-3 / 4, 1e-3])
    tokenizer = preferences.reward_tokenizer(reward_model.Args())
    alone = [
        sum(
            len(learnt_reward.reward_inputs(tokenizer, [p["prompt"]], [p[side]])["input_ids"][0])
            for side in ("chosen", "rejected")
        )
        for p in itertools.chain.from_iterable(sampled[:4])
    ]
    assert len(alone) == 24 and len(set(alone)) > 1  # lengths differ: padding in every micro-batch
    assert [tokens for _, _, tokens in logged] == list(
        itertools.accumulate(sum(alone[i : i + 6]) for i in range(0, 24, 6))
    )


@pytest.mark.parametrize("setting, on", [("off", False), ("auto", False), ("on", True)])
def test_gradient_checkpointing_recomputes_only_when_on(tmp_path, monkeypatch, setting, on):
    """--gradient-checkpointing off and auto (the reward model's memory bound counts its activations) keep them;
    only on recomputes."""
    _, _, model = recording_run(tmp_path, monkeypatch, num_steps=1, gradient_checkpointing=setting)
    assert model.is_activation_checkpointing == on


def write_pairs(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def good_rows(n=20):
    return [{"prompt": f"{i}=", "chosen": f"{i}", "rejected": f"{i + 1}"} for i in range(n)]


def test_jsonl_pairs_standard_and_conversational(tmp_path):
    train, test = preferences.load_pairs(f"jsonl:{write_pairs(tmp_path, good_rows())}", None, 0, 0, 0)
    assert len(train) == 18 and len(test) == 2 and {p["prompt"] for p in train}.isdisjoint(p["prompt"] for p in test)
    user, a, b = ({"role": r, "content": c} for r, c in (("user", "hi"), ("assistant", "hello"), ("assistant", "go")))
    explicit = preferences.check_pair({"prompt": [user], "chosen": [a], "rejected": [b]}, "here")
    implicit = preferences.check_pair({"chosen": [user, a], "rejected": [user, b]}, "here")  # TRL's implicit prompt
    assert explicit == implicit == {"prompt": [user], "chosen": [a], "rejected": [b], "where": "here"}
    assert preferences.check_pair({"prompt": "hi", "chosen": [a], "rejected": [b]}, "here")["prompt"] == [user]


def test_jsonl_held_out_split_keeps_each_prompts_pairs_on_one_side(tmp_path):
    """A prompt with several pairs (strings, or a conversation's turns) lands on one side of the split, whole: held
    out, none of its pairs is trained on."""
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    answer = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    rows = [{"prompt": f"{i}=", "chosen": f"{i}{j}", "rejected": f"{j}{i}9"} for i in range(30) for j in range(3)]
    rows += [
        {"prompt": user(f"c{i}"), "chosen": answer(f"a{j}"), "rejected": answer(f"b{j}")}
        for i in range(10)
        for j in range(2)
    ]
    train, test = preferences.load_pairs(f"jsonl:{write_pairs(tmp_path, rows)}", None, 0, 0, 0)
    key = lambda pair: json.dumps(pair["prompt"])  # noqa: E731
    assert len(train) + len(test) == len(rows) and test
    assert {key(p) for p in train}.isdisjoint(key(p) for p in test)
    held_out = collections.Counter(key(p) for p in test)
    assert all(held_out[k] == (3 if k.endswith('="') else 2) for k in held_out)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "1=", "chosen": "1", "rejected": "1"}, '"chosen" equals "rejected"'),
        ({"prompt": "1=", "chosen": "1"}, 'the key "rejected" is missing'),
        ({"chosen": "1", "rejected": "2"}, 'the key "prompt" is missing'),
        ({"prompt": "1=", "chosen": "", "rejected": "2"}, '"chosen" is empty'),
        ({"prompt": "1=", "chosen": "1", "rejected": "  "}, '"rejected" holds only whitespace'),
        ({"prompt": "1=", "chosen": 1, "rejected": "2"}, '"chosen" must be a string'),
        (
            {"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
            "no first turn",
        ),
        (
            {"prompt": "q", "chosen": [{"role": "assistant"}], "rejected": [{"role": "assistant", "content": "2"}]},
            r'"chosen"\[0\]\["content"\] must be a string',
        ),
        ({"prompt": "q", "chosen": [{"role": "assistant", "content": "1"}], "rejected": "2"}, "in one form"),
    ],
)
def test_bad_pairs_are_one_line_errors_naming_the_line(row, message, tmp_path):
    path = write_pairs(tmp_path, [*good_rows(3), row])
    with pytest.raises(UsageError, match=message) as error:
        reward_model.main(reward_model.Args(task=f"jsonl:{path}", output_dir=str(tmp_path / "runs")))
    assert "line 4" in str(error.value) and "\n" not in str(error.value)
    assert not os.path.exists(tmp_path / "runs") or not os.listdir(tmp_path / "runs")


def test_a_pair_longer_than_the_context_is_refused(tmp_path):
    path = write_pairs(tmp_path, [*good_rows(5), {"prompt": "1=", "chosen": "1" * 300, "rejected": "2"}])
    with pytest.raises(
        UsageError, match=r"line 6: its prompt and chosen completion are 302 tokens .* more than the 256 positions"
    ):
        reward_model.main(reward_model.Args(task=f"jsonl:{path}", output_dir=str(tmp_path)))


def test_a_reward_model_with_two_outputs_is_refused_by_ppo_and_grpo(tmp_path):
    """(The one-line exit of a UsageError on the command line: test_bad_input_cli.py.)"""
    from transformers import AutoModelForSequenceClassification

    folder = str(tmp_path / "two")
    model = AutoModelForSequenceClassification.from_pretrained(models.resolve_model_path("tiny"), num_labels=2)
    model.save_pretrained(folder)
    models.load_tokenizer("tiny").save_pretrained(folder)
    for module in (ppo, grpo):
        with pytest.raises(UsageError) as error:
            module.main(module.Args(reward_model=folder, num_steps=2, output_dir=str(tmp_path)))
        assert str(error.value) == (
            f"--reward-model {folder!r} is a classifier (Qwen2ForSequenceClassification) that "
            "has 2 outputs: a reward model has 1; train one with reward_model.py"
        )


def test_the_benchmarks_curves_read_the_dumps(trained, tmp_path):
    """benchmarks/rlhf.py's per-step figures from a PPO dump: the learnt reward is the dump's score, the gold reward
    that of its completions, the KL 0 at step 1 (the policy is the reference) and not after an update."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "rlhf.py")
    spec = importlib.util.spec_from_file_location("rlhf", path)
    rlhf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rlhf)
    dump_dir = str(tmp_path / "dump")
    flags = dict(num_steps=2, prompts_per_step=8, sample_every=0, learning_rate=0.05, output_dir=str(tmp_path))
    ppo.main(ppo.Args(reward_model=trained, dump_dir=dump_dir, **flags))
    rows = rlhf.curves(dump_dir)
    dump = load_file(os.path.join(dump_dir, "step000002.safetensors"))
    tokenizer = models.load_tokenizer(TINY_MODEL)
    prompts = tokenizer.batch_decode(dump["prompt_ids"], skip_special_tokens=True)
    texts = generation.decode_completions(tokenizer, dump["completion_ids"], dump["completion_mask"], [1])
    gold = [graded_copy_reward(p, c, p[:-1]) for p, c in zip(prompts, texts)]
    assert rows.shape == (2, 4) and rows[1, 0].item() == pytest.approx(dump["scores"].mean().item())
    assert rows[1, 1].item() == pytest.approx(sum(gold) / len(gold)) and rows[0, 2].item() == 0.0
    assert rows[1, 2].item() > 0.01


# ---------------------------------------------------------------------------------------------------
# Resume, and learning.
# ---------------------------------------------------------------------------------------------------


def test_a_resumed_run_is_the_uninterrupted_one(tmp_path):
    _, whole = run(tmp_path / "whole", num_steps=6)
    _, cut = run(tmp_path / "cut", num_steps=3, save_every=3)
    reward_model.main(reward_model.Args(**dict(SMALL, num_steps=6, resume=os.path.join(cut, "checkpoint"))))
    weights = [load_file(os.path.join(folder, "final", "model.safetensors")) for folder in (whole, cut)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_checkpoint_of_another_script_is_not_resumed(tmp_path):
    _, cut = run(tmp_path, num_steps=2, save_every=2)
    with pytest.raises(UsageError, match="is a checkpoint of reward_model.py, not ppo.py"):
        ppo.main(ppo.Args(num_steps=4, resume=os.path.join(cut, "checkpoint")))


@pytest.mark.slow
def test_a_short_run_learns(tmp_path):
    """60 steps on 1024 pairs: the held-out accuracy is far above a coin's (the default run reaches about 0.86)."""
    evaluation, _ = run(tmp_path, num_pairs=1024, num_steps=60, batch_size=64, micro_batch_size=64)
    assert evaluation["eval/accuracy"] > 0.7 and evaluation["eval/margin"] > 0.5


def test_a_forks_added_loss_term_is_logged_by_its_name_and_bt_loss_stays_the_bradley_terry_term(tmp_path, monkeypatch):
    """A fork adding a reward-centering term (Eisenstein et al.) in compute_loss only: losses/bt_loss is the
    Bradley-Terry term alone (summed over the micro-batches), losses/centering the added one, not folded together."""
    from test_loop_wiring import logged_scalars

    plain, seen = reward_model.compute_loss, []

    def compute_loss(outputs, batch, args):
        loss, terms = plain(outputs, batch, args)
        centering = 0.01 * (outputs["chosen"] + outputs["rejected"]).pow(2).sum() / batch["num_pairs"]
        seen.append((terms["bt_loss"].item(), centering.item()))
        return loss + centering, dict(terms, centering=centering.detach(), loss=(loss + centering).detach())

    monkeypatch.setattr(reward_model, "compute_loss", compute_loss)
    _, folder = run(tmp_path, num_steps=1)
    scalars = logged_scalars(folder)
    assert len(seen) == 2  # two micro-batches of 8 pairs
    assert scalars["losses/bt_loss"][1] == pytest.approx(sum(bt for bt, _ in seen), rel=1e-6)
    assert scalars["losses/centering"][1] == pytest.approx(sum(c for _, c in seen), rel=1e-6)
    assert sum(c for _, c in seen) > 1e-4  # a term big enough that folding it into bt_loss would show
