"""GRPO's logged losses/explained_variance: rewards against their own group's mean, computed here by a loop."""

import os

from safetensors.torch import load_file
from test_reproducibility import logged_scalars, only_run_dir

import grpo


def explained_variance_by_loop(rewards, group_size):
    """1 - Var(r - group mean of r) / Var(r), population variances over the batch's completions."""
    residuals = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        residuals += [r - sum(group) / len(group) for r in group]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)
    return 1 - var(residuals) / var(rewards)


def test_grpo_explained_variance_is_each_completion_against_its_group(tmp_path):
    """A reward with many values (distinct characters written), so a baseline from another group shows."""
    reward = tmp_path / "distinct.py"
    reward.write_text(
        'EXAMPLES = [{"prompt": f"{i}=", "answer": ""} for i in range(100)]\n'
        "def reward(prompt, completion, answer):\n    return len(set(completion)) / 4\n"
    )
    args = grpo.Args(
        seed=5,
        num_steps=2,
        prompts_per_step=4,
        group_size=3,
        max_new_tokens=4,
        learning_rate=3e-2,
        task=f"python:{reward}:reward",
        sample_every=0,
        output_dir=str(tmp_path / "runs"),
        dump_dir=str(tmp_path / "dump"),
    )
    grpo.main(args)
    logged = dict(logged_scalars(only_run_dir(tmp_path / "runs"))["losses/explained_variance"])
    for step in (1, 2):
        rewards = load_file(os.path.join(tmp_path, "dump", f"step{step:06d}.safetensors"))["rewards"].tolist()
        assert len(set(rewards)) > 2  # groups differ, so a baseline from the wrong group shows
        assert abs(logged[step] - explained_variance_by_loop(rewards, 3)) < 1e-5, (step, rewards)
