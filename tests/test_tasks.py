"""tasks.py: the copy reward by hand, and a broken reward function stops the run with a UsageError."""

import pytest

from machinery.errors import UsageError
from tasks import Task, copy_task, load_task
from tasks.rewards import copy_reward


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("123", 1.0),
        ("12", 2 / 3),
        ("1234", 3 / 4),
        ("321", 1 / 3),
        ("", 0.0),
        ("9999999", 0.0),
        ("124", 2 / 3),
        ("923", 2 / 3),
        ("132", 1 / 3),
        ("456", 0.0),
        ("231", 0.0),
        ("312", 0.0),
    ],
)
def test_copy_reward_hand_values(completion, reward):
    """Wrong answers of the right length ("124", "231", "312") earn only their characters in the right place:
    guards a reward that counts shared characters anywhere, or gives credit for the length alone."""
    assert copy_reward("123=", completion, "123") == pytest.approx(reward)


def test_copy_task_split():
    task = copy_task()
    assert len(task.train) == 900 and len(task.test) == 100
    assert not {ex["prompt"] for ex in task.train} & {ex["prompt"] for ex in task.test}
    assert all(ex["prompt"] == ex["answer"] + "=" for ex in task.train)


@pytest.mark.parametrize(
    "bad_reward", [lambda p, c, a: 1 / 0, lambda p, c, a: float("nan"), lambda p, c, a: True, lambda p, c, a: "1"]
)
def test_broken_reward_function_is_a_usage_error(bad_reward):
    task = Task("broken", [], [], bad_reward)
    with pytest.raises(UsageError, match="broken"):
        task.score(["1="], ["1"], ["1"])


def test_unknown_task_is_a_usage_error():
    with pytest.raises(UsageError, match="nosuchtask"):
        load_task("nosuchtask")


def test_held_out_split_is_a_fixed_shuffle():
    """split_examples holds out 10% chosen by a fixed-seed shuffle: not the first lines of the data (a file sorted by
    difficulty or topic would give an unrepresentative held-out set), the same on every run, disjoint from the
    training examples, and without reordering the caller's list. Guards a split without the shuffle, or an unseeded
    one."""
    from tasks import split_examples

    examples = [{"prompt": f"{i}=", "answer": str(i)} for i in range(100)]
    train, test = split_examples("ordered", examples)
    assert len(test) == 10 and len(train) == 90
    held_out = sorted(int(ex["answer"]) for ex in test)
    assert sorted(held_out + [int(ex["answer"]) for ex in train]) == list(range(100))
    assert held_out != list(range(10)) and held_out != list(range(90, 100)) and max(held_out) - min(held_out) > 50
    assert split_examples("ordered", examples) == (train, test)
    assert [ex["answer"] for ex in examples] == [str(i) for i in range(100)]


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("Paris", "Paris", 1.0),
        (" Paris\n", "Paris", 1.0),
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("paris", "Paris", 0.0),
        ("3.50", "3.5", 1.0),
        ("1,000", "1000", 1.0),
        ("Paris", "3", 0.0),
        ("3", "Paris", 0.0),
    ],
)
def test_match_reward_on_text_answers(completion, answer, reward):
    """Two texts that are not numbers match only when equal (two unparsable numbers are not the same number)."""
    from tasks.rewards import match_reward

    assert match_reward("?", completion, answer) == reward
