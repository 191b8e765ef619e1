"""grpo.py's rollout as a unit: rounds joined with their padding, and DAPO's dynamic sampling."""

import random

import pytest
import torch

import common
import grpo
from machinery import batches


def fake_round(rewards, prompt_width, completion_width, tag):
    """A rollout batch of len(rewards) rows whose ids say which round and row they came from."""
    n = len(rewards)
    ids = torch.arange(n)[:, None] + 100 * tag
    return dict(
        prompts=[f"p{tag}.{i}" for i in range(n)],
        completions=[f"c{tag}.{i}" for i in range(n)],
        prompt_ids=ids.expand(n, prompt_width).clone(),
        prompt_mask=torch.ones(n, prompt_width, dtype=torch.long),
        completion_ids=ids.expand(n, completion_width).clone(),
        completion_mask=torch.ones(n, completion_width, dtype=torch.long),
        scores=torch.tensor(rewards),
    )


def test_concat_batches_pads_prompts_left_and_completions_right():
    a, b = fake_round([0.0, 1.0], 3, 2, tag=1), fake_round([1.0], 1, 4, tag=2)
    joined = batches.concat_batches(a, b)
    assert joined["prompts"] == ["p1.0", "p1.1", "p2.0"]
    assert joined["prompt_mask"].tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1]]  # left padding
    assert joined["prompt_ids"][2].tolist() == [0, 0, 200]
    assert joined["completion_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]  # right padding
    assert joined["completion_ids"][0].tolist() == [100, 100, 0, 0]
    assert joined["scores"].tolist() == [0.0, 1.0, 1.0]
    picked = common.select_rows(joined, torch.tensor([2, 0]))
    assert picked["completions"] == ["c2.0", "c1.0"] and picked["scores"].tolist() == [1.0, 0.0]


def run_dynamic_sampling(rounds, prompts_per_step=2, group_size=2, max_rounds=3):
    """dynamic_sampling over scripted rounds; returns the batch and how many rounds were drawn."""
    drawn = []

    def sample():
        drawn.append(len(drawn))
        return fake_round(rounds[len(drawn) - 1], 2, 2 + len(drawn), tag=len(drawn))

    args = grpo.Args(prompts_per_step=prompts_per_step, group_size=group_size, max_sampling_rounds=max_rounds)
    batch, rounds = grpo.dynamic_sampling(sample, args)
    assert rounds == len(drawn)
    return batch, rounds


def test_dynamic_sampling_stops_once_enough_groups_differ():
    batch, drawn = run_dynamic_sampling([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert drawn == 1  # both groups of the first round differ: no second round
    assert batch["prompts"] == ["p1.0", "p1.1", "p1.2", "p1.3"]


def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ():
    # round 1: groups (1, 1) equal and (0, 1) informative; round 2: (0, 0) equal and (1, 0) informative
    batch, drawn = run_dynamic_sampling([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    assert drawn == 2
    assert batch["prompts"] == ["p1.2", "p1.3", "p2.2", "p2.3"]  # the two informative groups, in order
    assert batch["scores"].view(-1, 2).std(1).gt(0).all()
    assert batch["completion_ids"].shape == (4, 4)  # round 2's width; round 1's rows padded on the right
    assert batch["completion_mask"][:2].sum(1).tolist() == [3, 3]


def test_dynamic_sampling_fills_with_equal_groups_after_the_last_round():
    batch, drawn = run_dynamic_sampling(
        [[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]], max_rounds=2
    )
    assert drawn == 2
    assert len(batch["scores"]) == 4  # always prompts_per_step groups: the step's shapes never change
    assert batch["prompts"][:2] == ["p2.0", "p2.1"]  # the one informative group first, then the first equal one
    assert batch["prompts"][2:] == ["p1.0", "p1.1"]


def kept_by_hand(rounds, prompts_per_step, group_size, max_rounds):
    """Which rows dynamic sampling must keep, written without tensors: the rounds are drawn until prompts_per_step
    groups (of group_size rows) have rewards that differ, or max_rounds were; then the informative groups in the
    order they were drawn, then the equal ones, prompts_per_step of them. Returns (rows as "p{round}.{row}", rounds)."""
    groups = []  # (informative, round, first row)
    for tag, rewards in enumerate(rounds[:max_rounds], start=1):
        for start in range(0, len(rewards), group_size):
            groups.append((len(set(rewards[start : start + group_size])) > 1, tag, start))
        if sum(informative for informative, _, _ in groups) >= prompts_per_step:
            break
    ordered = [g for g in groups if g[0]] + [g for g in groups if not g[0]]
    rows = [f"p{tag}.{start + j}" for _, tag, start in ordered[:prompts_per_step] for j in range(group_size)]
    return rows, tag


@pytest.mark.parametrize("prompts_per_step, group_size", [(3, 2), (2, 3), (2, 5)])
def test_dynamic_sampling_keeps_the_groups_counted_by_hand(prompts_per_step, group_size):
    """Prompts per step and group size differ (both ways), so a row index or a group count built from the wrong one
    of the two keeps other rows; random rounds of 0/1 rewards, some groups equal, checked against kept_by_hand."""
    rng = random.Random(prompts_per_step * 10 + group_size)
    seen_rounds, fills = set(), 0
    for _ in range(40):
        n = prompts_per_step * group_size
        odds = rng.choice([0.1, 0.3, 0.5])  # rare 1s: many groups all 0, so more rounds and some fills
        rounds = [[float(rng.random() < odds) for _ in range(n)] for _ in range(3)]
        batch, drawn = run_dynamic_sampling(rounds, prompts_per_step, group_size, max_rounds=3)
        rows, expected_rounds = kept_by_hand(rounds, prompts_per_step, group_size, max_rounds=3)
        assert drawn == expected_rounds
        assert batch["prompts"] == rows
        assert batch["completions"] == [p.replace("p", "c") for p in rows]
        ids = [100 * int(tag) + int(row) for tag, row in (p[1:].split(".") for p in rows)]
        assert batch["completion_ids"][:, 0].tolist() == ids  # the tensors picked the same rows as the lists
        assert batch["scores"].tolist() == [rounds[i // 100 - 1][i % 100] for i in ids]
        seen_rounds.add(drawn)
        fills += not batch["scores"].view(-1, group_size).std(1).gt(0).all()
    assert seen_rounds == {1, 2, 3} and fills > 0  # the scripts stopped after each number of rounds, and some filled


def test_a_step_with_dynamic_sampling_trains_on_informative_groups(tmp_path, monkeypatch):
    """3 prompts a step in groups of 4: each kept group is 4 rows of one prompt, whose rewards differ."""
    monkeypatch.chdir(tmp_path)
    args = grpo.Args(
        num_steps=2,
        prompts_per_step=3,
        group_size=4,
        dynamic_sampling=True,
        max_sampling_rounds=4,
        dump_dir=str(tmp_path / "dumps"),
        sample_every=0,
    )
    grpo.main(args)
    from safetensors.torch import load_file

    d = load_file(str(tmp_path / "dumps" / "step000002.safetensors"))
    assert d["rewards"].shape == (12,)
    assert d["rewards"].view(3, 4).std(1).gt(0).all()  # copy's partial credit: 4 rounds always find 3 such groups
    prompts = d["prompt_ids"].view(3, 4, -1)
    assert torch.equal(prompts, prompts[:, :1].expand_as(prompts))  # a group's rows share their prompt
    assert not torch.equal(prompts[0, 0], prompts[1, 0])  # and the groups are different prompts


def test_dynamic_sampling_under_torchrun_fills_each_processs_share(monkeypatch):
    """On 2 processes each samples and keeps its own prompts_per_step / 2 groups: 4 prompts a step are 2 groups
    here, which the first round's 2 informative groups fill (not the whole step's 4, which would draw again)."""
    monkeypatch.setattr(grpo.dist, "world_size", lambda: 2)
    batch, drawn = run_dynamic_sampling([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]], prompts_per_step=4)
    assert drawn == 1 and batch["prompts"] == ["p1.0", "p1.1", "p1.2", "p1.3"]
