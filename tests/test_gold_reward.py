"""RLHF's held-out watch (machinery/gold.py) and tasks of prompts alone (tasks/prompts.py): with --reward-model the
task's own reward is the gold, logged on the held-out prompts and never trained on; the logged gold, reward model
score and KL equal an independent computation on the same completions; a JSONL of prompts alone works with
--reward-model and is refused without one, in a line that says what works."""

import glob
import json
import os

import pytest
import torch

import grpo
import ppo
from machinery import generation, gold, learnt_reward, models
from machinery.errors import UsageError
from tasks import load_task

CPU = torch.device("cpu")
GOLD_FILE = """
SEEN = []

def gold(prompt, completion, answer):
    SEEN.append(prompt)
    return completion.count("7") / 5 + (answer == "") * 0.5
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny reward model (a random head on the tiny model), a file of prompts alone, one of prompts and answers,
    and a gold reward function."""
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path_factory.mktemp("gold")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(models.resolve_model_path("tiny"), num_labels=1)
    model.save_pretrained(folder / "rm")
    models.load_tokenizer("tiny").save_pretrained(folder / "rm")
    paths = {"rm": str(folder / "rm"), "gold": str(folder / "gold.py")}
    (folder / "gold.py").write_text(GOLD_FILE)
    rows = {
        "alone": [{"prompt": f"{i:03d}="} for i in range(60)],
        "messages": [{"messages": [{"role": "user", "content": f"{i:03d}="}]} for i in range(30)]
        + [{"prompt": [{"role": "user", "content": f"{i:03d}="}]} for i in range(30, 60)],
        "answers": [{"prompt": f"{i:03d}=", "answer": f"{i:03d}"} for i in range(60)],
        "mixed": [{"prompt": "1=", "answer": "1"}, {"prompt": "2="}],
        "system": [{"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "1="}]}],
        "assistant": [{"prompt": [{"role": "assistant", "content": "1"}]}],
        "neither": [{"question": "1="}],
    }
    for name, lines in rows.items():
        paths[name] = str(folder / f"{name}.jsonl")
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in lines)
    return paths


def scalars_of(run_root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = glob.glob(os.path.join(run_root, "*"))
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_prompts_alone_read_as_prompts_with_an_empty_answer(files):
    task = load_task(f"jsonl:{files['alone']}")
    assert task.answers == "none" and len(task.train) == 54 and len(task.test) == 6
    assert all(ex["answer"] == "" and ex["prompt"].endswith("=") for ex in task.train + task.test)
    messages = load_task(f"jsonl:{files['messages']}")
    assert sorted(ex["prompt"] for ex in messages.train + messages.test) == [f"{i:03d}=" for i in range(60)]
    assert load_task(f"jsonl:{files['answers']}").answers == "written"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("mixed", 'line 2 has no "answer" while line 1 has one: give every line an "answer", or none'),
        ("system", '"messages" holds 2 messages: a prompt here is one user message (pass a system turn with'),
        ("assistant", '"prompt"[0] must be {"role": "user", "content": "..."}'),
        ("neither", 'line 1: the key "prompt" is missing; write {"prompt": "..."} (prompts alone, with'),
    ],
)
def test_a_file_of_prompts_that_is_not_one_is_refused_in_one_line(files, name, expected):
    with pytest.raises(UsageError, match=None) as error:
        load_task(f"jsonl:{files[name]}")
    assert expected in str(error.value) and "\n" not in str(error.value)


def quick(script, tmp_path, **overrides):
    module = {"grpo": grpo, "ppo": ppo}[script]
    sizes = dict(prompts_per_step=2, group_size=3) if script == "grpo" else dict(prompts_per_step=4)
    args = dict(seed=1, num_steps=2, max_new_tokens=4, sample_every=0, output_dir=str(tmp_path), **sizes)
    return module.main(module.Args(**dict(args, **overrides)))


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_prompts_alone_train_against_a_reward_model_and_log_its_score_and_the_kl(files, script, tmp_path):
    quick(script, tmp_path, task=f"jsonl:{files['alone']}", reward_model=files["rm"], eval_every=1)
    scalars = scalars_of(str(tmp_path))
    assert len(scalars["eval/reward_model_score"]) == 2 and len(scalars["eval/kl_ref"]) == 2
    assert "eval/gold_reward" not in scalars and "eval/accuracy" not in scalars  # prompts alone: no gold to log
    assert scalars["eval/kl_ref"][1] != 0  # the policy moved from the reference


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_prompts_alone_without_a_reward_model_are_refused_with_what_works(files, script, tmp_path):
    with pytest.raises(UsageError) as error:
        quick(script, tmp_path, task=f"jsonl:{files['alone']}")
    assert "holds prompts alone" in str(error.value) and "pass --reward-model RUN/final" in str(error.value)
    assert not os.listdir(tmp_path)  # refused before the run folder is made


def test_the_gold_is_never_trained_on_only_logged_on_held_out_prompts(files, tmp_path, capsys):
    task_name = f"python:{files['gold']}:gold@{files['alone']}"
    quick("grpo", tmp_path, task=task_name, reward_model=files["rm"], eval_every=2, num_steps=4)
    assert "the gold, never trained on, logged as eval/gold_reward on the held-out prompts every 2" in (
        capsys.readouterr().out
    )
    import user_task_gold  # the reward file as tasks/user.py imported it

    held_out = {ex["prompt"] for ex in load_task(task_name).test}
    assert len(user_task_gold.SEEN) == 2 * len(held_out) and set(user_task_gold.SEEN) == held_out
    scalars = scalars_of(str(tmp_path))
    assert len(scalars["eval/gold_reward"]) == 2 and min(scalars["eval/gold_reward"]) >= 0.5  # answer "": +0.5


def test_the_logged_gold_score_and_kl_equal_an_independent_computation(files, monkeypatch):
    """held_out_rlhf on a reference 0.1 away from the policy: its scalars against the gold function, the reward
    model's forward pass and a full-softmax log-prob of each sampled token, on the completions it sampled; the
    run's random state untouched."""
    task = load_task(f"python:{files['gold']}:gold@{files['answers']}")
    tokenizer, policy = models.load_tokenizer("tiny"), models.load_causal_lm("tiny", CPU)
    ref = models.load_causal_lm("tiny", CPU)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    scorer = learnt_reward.RewardModel(files["rm"], CPU, torch.float32)
    args = grpo.Args(reward_model=files["rm"], max_new_tokens=5, temperature=0.7, seed=5)
    sampled, generate = [], generation.generate
    monkeypatch.setattr(generation, "generate", lambda *a, **k: sampled.append(generate(*a, **k)) or sampled[-1])
    state = torch.get_rng_state()
    eos_ids = models.eos_token_ids(policy, tokenizer)
    logged = gold.held_out_rlhf(policy, ref, scorer, tokenizer, task, args, eos_ids, CPU, torch.float32)
    assert torch.equal(torch.get_rng_state(), state)
    ((prompt_ids, prompt_mask, ids, mask),) = sampled
    texts = generation.decode_completions(tokenizer, ids, mask, eos_ids)
    prompts, answers = [ex["prompt"] for ex in task.test], [ex["answer"] for ex in task.test]
    by_hand = [c.count("7") / 5 + (a == "") * 0.5 for c, a in zip(texts, answers)]
    assert logged["eval/gold_reward"] == pytest.approx(sum(by_hand) / len(by_hand), abs=1e-6)
    enc = learnt_reward.reward_inputs(scorer.tokenizer, prompts, texts)
    with torch.no_grad():
        proxy = scorer.model(**enc).logits[:, 0]
    assert logged["eval/reward_model_score"] == pytest.approx(proxy.mean().item(), abs=1e-5)
    kl = []
    for row in range(len(texts)):
        n = int(mask[row].sum())
        tokens = torch.cat([prompt_ids[row][prompt_mask[row].bool()], ids[row, :n]])
        pieces = []
        for model in (policy, ref):
            with torch.no_grad():
                logits = model(tokens[None]).logits[0, -n - 1 : -1] / 0.7
            pieces.append(torch.log_softmax(logits.double(), -1).gather(1, tokens[-n:, None]).sum())
        kl.append((pieces[0] - pieces[1]).item())
    assert logged["eval/kl_ref"] == pytest.approx(sum(kl) / len(kl), rel=1e-4)
    assert logged["eval/completion_length"] == pytest.approx(mask.sum(1).float().mean().item())
