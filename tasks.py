"""Tasks: where prompts come from and how completions are scored.

A task is a list of training examples, a held-out list, and a reward function
`reward(prompt, completion, answer) -> float` in [0, 1]. `load_task(name)` builds one by name.
"""

import math
import random
from dataclasses import dataclass
from typing import Callable

from common import UsageError


@dataclass
class Task:
    name: str
    train: list  # [{"prompt": str, "answer": str}, ...]
    test: list
    reward_fn: Callable[[str, str, str], float]

    def score(self, prompts, completions, answers):
        """Rewards for a batch, checked: a reward function that raises or returns a non-number stops the run."""
        rewards = []
        for prompt, completion, answer in zip(prompts, completions, answers):
            try:
                r = self.reward_fn(prompt, completion, answer)
            except Exception as e:
                raise UsageError(
                    f"reward function of task {self.name!r} raised {type(e).__name__}: {e} "
                    f"on prompt {prompt!r} and completion {completion!r}: fix the reward function"
                ) from None
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
                raise UsageError(
                    f"reward function of task {self.name!r} returned {r!r} on prompt {prompt!r} and completion "
                    f"{completion!r}: it must return a finite number"
                )
            rewards.append(float(r))
        return rewards


class PromptSampler:
    """Endless shuffled passes over the training examples, with its own seeded RNG (so resumable)."""

    def __init__(self, examples, seed):
        self.examples, self.rng, self.order = examples, random.Random(seed), []

    def sample(self, n):
        batch = []
        while len(batch) < n:
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
            batch.append(self.examples[self.order.pop()])
        return batch


# ---------------------------------------------------------------------------------------------------
# copy: the built-in default task. The tiny model learns it from scratch in a few minutes on a CPU.
# ---------------------------------------------------------------------------------------------------


def copy_reward(prompt, completion, answer):
    """Share of characters in the right place, over the longer of answer and completion.

    A random completion gets about 0.1 per digit; only the exact copy followed by EOS gets 1.
    There is no credit for format alone, so no constant answer can trap the policy.
    """
    completion = completion.strip()
    hits = sum(a == c for a, c in zip(answer, completion))
    return hits / max(len(answer), len(completion))


def copy_task(digits=3, seed=1234):
    """Prompt "123=" -> answer "123": all 1000 three-digit strings, 900 to train on and 100 held out."""
    strings = [f"{i:0{digits}d}" for i in range(10**digits)]
    random.Random(seed).shuffle(strings)
    examples = [{"prompt": f"{s}=", "answer": s} for s in strings]
    n_test = len(examples) // 10
    return Task("copy", examples[n_test:], examples[:n_test], copy_reward)


TASKS = {"copy": copy_task}


def load_task(name):
    if name in TASKS:
        return TASKS[name]()
    raise UsageError(f"unknown task {name!r}: pass --task with one of {', '.join(sorted(TASKS))}")
