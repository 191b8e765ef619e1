"""GRPO's per-group logs, each against a loop written here, in a run of 4 prompts in groups of 3 (so a group taken
as prompts_per_step rows shows): losses/explained_variance (rewards against their own group's mean),
charts/informative_groups (the share of groups whose rewards differ) and the completions --sample-every prints
(the first of each of the first 3 groups)."""

import os

from safetensors.torch import load_file
from test_reproducibility import logged_scalars, only_run_dir

import grpo
from machinery import generation, models
from machinery.tiny_model import TINY_MODEL


def explained_variance_by_loop(rewards, group_size):
    """1 - Var(r - group mean of r) / Var(r), population variances over the batch's completions."""
    residuals = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        residuals += [r - sum(group) / len(group) for r in group]
    var = lambda xs: sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / len(xs)
    return 1 - var(residuals) / var(rewards)


def informative_share_by_loop(rewards, group_size):
    groups = [rewards[start : start + group_size] for start in range(0, len(rewards), group_size)]
    return sum(len(set(group)) > 1 for group in groups) / len(groups)


def printed_lines(d, step, rows, scores="rewards"):
    """What --sample-every prints for these rows of a dumped step: prompt, completion and score (the task's:
    GRPO's rewards, PPO's scores)."""
    tokenizer = models.load_tokenizer(TINY_MODEL)
    prompts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(d["prompt_ids"], d["prompt_mask"])]
    completions = generation.decode_completions(
        tokenizer, d["completion_ids"], d["completion_mask"], [tokenizer.eos_token_id]
    )
    return [f"step {step} | {prompts[i]!r} -> {completions[i]!r} | score {d[scores][i].item():.2f}" for i in rows]


def test_grpo_group_logs_are_each_completion_against_its_group(tmp_path, capsys):
    """A reward with many values (distinct characters written), so a baseline from another group shows; constant on
    prompts that are multiples of 3, so some groups are all equal."""
    reward = tmp_path / "distinct.py"
    reward.write_text(
        'EXAMPLES = [{"prompt": f"{i}=", "answer": ""} for i in range(100)]\n'
        "def reward(prompt, completion, answer):\n"
        "    return len(set(completion)) / 4 if int(prompt[:-1]) % 3 else 0.5\n"
    )
    args = grpo.Args(
        seed=5,
        num_steps=2,
        prompts_per_step=4,
        group_size=3,
        max_new_tokens=4,
        learning_rate=3e-2,
        task=f"python:{reward}:reward",
        sample_every=1,
        output_dir=str(tmp_path / "runs"),
        dump_dir=str(tmp_path / "dump"),
    )
    grpo.main(args)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    scalars = logged_scalars(only_run_dir(tmp_path / "runs"))
    logged, informative = (dict(scalars[tag]) for tag in ("losses/explained_variance", "charts/informative_groups"))
    shares, expected_lines = [], []
    for step in (1, 2):
        d = load_file(os.path.join(tmp_path, "dump", f"step{step:06d}.safetensors"))
        rewards = d["rewards"].tolist()
        assert len(rewards) == 4 * 3  # every prompt of the step, each in a group of 3
        assert len(set(rewards)) > 2  # groups differ, so a baseline from the wrong group shows
        assert abs(logged[step] - explained_variance_by_loop(rewards, 3)) < 1e-5, (step, rewards)
        shares.append(informative_share_by_loop(rewards, 3))
        assert abs(informative[step] - shares[-1]) < 1e-6, (step, rewards)
        expected_lines += printed_lines(d, step, [0, 3, 6])
        assert printed_lines(d, step, [0, 3, 6]) != printed_lines(d, step, [0, 4, 8])  # another group's rows show
    assert any(0 < share < 1 for share in shares)  # some groups all equal, some not
    assert printed == expected_lines
