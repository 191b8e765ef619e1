"""tasks.py: the copy reward by hand, and a broken reward function stops the run with a UsageError."""

import pytest

from common import UsageError
from tasks import Task, copy_reward, copy_task, load_task


@pytest.mark.parametrize(
    "completion, reward",
    [("123", 1.0), ("12", 2 / 3), ("1234", 3 / 4), ("321", 1 / 3), ("", 0.0), ("9999999", 0.0),
     ("124", 2 / 3), ("923", 2 / 3), ("132", 1 / 3), ("456", 0.0), ("231", 0.0), ("312", 0.0)],
)  # fmt: skip
def test_copy_reward_hand_values(completion, reward):
    """Wrong answers of the right length ("124", "231", "312") earn only their characters in the right place:
    guards a reward that counts shared characters anywhere, or gives credit for the length alone."""
    assert copy_reward("123=", completion, "123") == pytest.approx(reward)


def test_copy_task_split():
    task = copy_task()
    assert len(task.train) == 900 and len(task.test) == 100
    assert not {ex["prompt"] for ex in task.train} & {ex["prompt"] for ex in task.test}
    assert all(ex["prompt"] == ex["answer"] + "=" for ex in task.train)


@pytest.mark.parametrize("bad_reward", [lambda p, c, a: 1 / 0, lambda p, c, a: float("nan"), lambda p, c, a: True, lambda p, c, a: "1"])
def test_broken_reward_function_is_a_usage_error(bad_reward):
    task = Task("broken", [], [], bad_reward)
    with pytest.raises(UsageError, match="broken"):
        task.score(["1="], ["1"], ["1"])


def test_unknown_task_is_a_usage_error():
    with pytest.raises(UsageError, match="nosuchtask"):
        load_task("nosuchtask")
