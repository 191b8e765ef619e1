"""LoRA (--lora-rank, lora.py): the reference is the base, the saved adapters and merged model are the run's policy,
a resumed run is the run it continues, and bad LoRA flags get one line. Skipped without peft."""

import copy
import glob
import os

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft", reason="peft is not installed (pip install -r requirements/lora.txt)")

import common  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402
from machinery import checkpoints, lora, models  # noqa: E402
from machinery.errors import UsageError  # noqa: E402
from machinery.tiny_model import TINY_MODEL

SCRIPTS = {"grpo": grpo, "ppo": ppo}


def lora_args(script, tmp_path, **overrides):
    args = dict(
        seed=1,
        num_steps=1,
        prompts_per_step=4,
        max_new_tokens=4,
        sample_every=0,
        output_dir=str(tmp_path / "runs"),
        lora_rank=4,
        learning_rate=1e-2,
    )
    args.update(dict(group_size=4) if script == "grpo" else dict(samples_per_prompt=1, num_minibatches=2))
    args.update(overrides)
    return SCRIPTS[script].Args(**args)


def dumped(dump_dir):
    return [load_file(path) for path in sorted(glob.glob(os.path.join(dump_dir, "step*.safetensors")))]


def logprobs(model, d):
    """The log-probs of `model` (temperature 1) on a dumped batch."""
    input_ids = torch.cat([d["prompt_ids"], d["completion_ids"]], 1)
    attention_mask = torch.cat([d["prompt_mask"], d["completion_mask"]], 1)
    with torch.no_grad():
        return common.token_logprobs(model.eval(), input_ids, attention_mask, d["completion_mask"], 1.0)


@pytest.mark.exact
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_step_one_kl_is_exactly_zero(script, dtype, tmp_path):
    """At step 1 the adapters' B is 0, so the policy computes what its base (the reference, adapters off) does:
    the same bits, in float32 and under bf16 autocast alike."""
    args = lora_args(script, tmp_path, dtype=dtype, dump_dir=str(tmp_path / "dump"))
    SCRIPTS[script].main(args)
    (d,) = dumped(tmp_path / "dump")
    policy_logp = d["new_logp"] if script == "grpo" else d["old_logp"]
    assert d["completion_mask"].sum() > 0
    assert torch.equal(policy_logp, d["ref_logp"])


@pytest.mark.exact
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_reference_stays_the_base_model(script, tmp_path):
    """After 3 updates the policy has moved, and the reference's log-probs are still the base model's, bit for bit:
    the base is frozen, and switching the adapters off leaves nothing of them. The reference is no second copy."""
    args = lora_args(script, tmp_path, num_steps=3, dump_dir=str(tmp_path / "dump"))
    loads = []
    load = models.load_pretrained
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(models, "load_pretrained", lambda *a, **k: loads.append(a) or load(*a, **k))
        SCRIPTS[script].main(args)
    assert len(loads) == (1 if script == "grpo" else 2)  # the policy (and PPO's critic), no reference
    d = dumped(tmp_path / "dump")[-1]
    base = models.load_causal_lm(TINY_MODEL, models.CPU)
    assert torch.equal(logprobs(base, d), d["ref_logp"])
    policy_logp = d["new_logp"] if script == "grpo" else d["old_logp"]
    assert (policy_logp - d["ref_logp"]).abs().max() > 1e-3  # the policy did move


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_saved_adapters_and_merged_model_are_the_last_policy(script, tmp_path, monkeypatch):
    """The final adapters load with peft's PeftModel.from_pretrained on the base, the merged model with plain
    AutoModelForCausalLM.from_pretrained, and both give the log-probs of the run's own last policy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    last = {}
    save_model = checkpoints.save_model
    monkeypatch.setattr(
        checkpoints,
        "save_model",
        lambda model, tokenizer, folder, **kw: (
            last.setdefault(os.path.basename(folder), copy.deepcopy(model)),
            save_model(model, tokenizer, folder, **kw),
        )[1],
    )
    SCRIPTS[script].main(lora_args(script, tmp_path, num_steps=3, lora_merged=True, dump_dir=str(tmp_path / "dump")))
    (final,) = glob.glob(str(tmp_path / "runs" / "*" / "final"))
    d = dumped(tmp_path / "dump")[-1]
    expected = logprobs(last["final"], d)
    assert (expected - d["ref_logp"]).abs().max() > 1e-3  # trained: the adapters matter
    adapted = PeftModel.from_pretrained(models.load_causal_lm(TINY_MODEL, models.CPU), final)
    torch.testing.assert_close(logprobs(adapted, d), expected, rtol=0, atol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(final + "-merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logprobs(merged, d), expected, rtol=0, atol=1e-5)  # W + B A rounds once


@pytest.mark.exact
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_resume_continues_bit_exactly(script, tmp_path):
    """4 steps at once, and 2 steps then 2 more from the checkpoint: the same adapters (and PPO's critic adapters
    and value head) and the same optimizer state, bit for bit."""
    SCRIPTS[script].main(lora_args(script, tmp_path / "a", num_steps=4, save_every=2))
    SCRIPTS[script].main(lora_args(script, tmp_path / "b", num_steps=2, save_every=2))
    (first,) = glob.glob(str(tmp_path / "b" / "runs" / "*" / "checkpoint"))
    SCRIPTS[script].main(lora_args(script, tmp_path / "b", num_steps=4, save_every=2, resume=first))  # in b's folder
    (straight,) = glob.glob(str(tmp_path / "a" / "runs" / "*" / "checkpoint"))
    assert checkpoints.read_state(first)[0]["step"] == 4
    resumed = first
    files = sorted(os.path.relpath(p, straight) for p in glob.glob(os.path.join(straight, "*", "*.safetensors")))
    assert "policy/adapter_model.safetensors" in files and "policy/model.safetensors" not in files
    for name in files:
        a, b = load_file(os.path.join(straight, name)), load_file(os.path.join(resumed, name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    a, b = (checkpoints.read_state(f)[0]["optimizer"]["state"] for f in (straight, resumed))
    assert a.keys() == b.keys() and len(a) > 0
    for index in a:
        assert all(torch.equal(a[index][k], b[index][k]) for k in a[index])


@pytest.mark.exact
def test_ppo_critic_has_its_own_frozen_base(tmp_path, monkeypatch):
    """PPO's critic: its own adapters on its own copy of the base, both frozen; no tensor shared with the policy."""
    seen = {}
    monkeypatch.setattr(
        checkpoints,
        "save_model",
        lambda model, tokenizer, folder, **kw: seen.setdefault(os.path.basename(folder), model),
    )
    ppo.main(lora_args("ppo", tmp_path, num_steps=2))
    policy, critic = seen["final"], seen["critic"]
    trained = {name for name, p in critic.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name or name.startswith("value_head.") for name in trained)
    assert all("lora_" in name for name, p in policy.named_parameters() if p.requires_grad)
    assert not {p.data_ptr() for p in policy.parameters()} & {p.data_ptr() for p in critic.parameters()}
    base = models.load_backbone(TINY_MODEL, models.CPU).state_dict()
    frozen = {
        k.removeprefix("backbone.").replace(".base_layer", ""): v
        for k, v in critic.state_dict().items()
        if "lora_" not in k
    }
    assert all(torch.equal(base[k], frozen[k]) for k in base)


def one_line(excinfo):
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(lora_rank=-1), "--lora-rank is -1: it must be a positive integer"),
        (dict(lora_alpha=0.0), "--lora-alpha is 0.0: it must be > 0"),
        (dict(lora_dropout=1.0), "--lora-dropout is 1.0: it must be in"),
        (dict(lora_rank=0, lora_merged=True), "--lora-merged acts only on LoRA adapters, and --lora-rank is 0"),
        (dict(lora_target_modules=("qkv_proj",)), "--lora-target-modules qkv_proj names no linear or embedding layer"),
        (
            dict(lora_target_modules=("input_layernorm",)),
            "--lora-target-modules input_layernorm names no linear .* its linear layers are .*q_proj",
        ),
    ],
)
def test_bad_lora_flags_get_one_line(overrides, expected, tmp_path):
    with pytest.raises(UsageError, match=expected) as excinfo:
        grpo.main(lora_args("grpo", tmp_path, **overrides))
    one_line(excinfo)


def test_resume_refuses_to_switch_lora_on_or_off(tmp_path):
    grpo.main(lora_args("grpo", tmp_path / "lora", num_steps=1, save_every=1))
    grpo.main(lora_args("grpo", tmp_path / "full", num_steps=1, save_every=1, lora_rank=0))
    (with_lora,) = glob.glob(str(tmp_path / "lora" / "runs" / "*" / "checkpoint"))
    (without,) = glob.glob(str(tmp_path / "full" / "runs" / "*" / "checkpoint"))
    with pytest.raises(UsageError, match="was run with --lora-rank 4, not 0") as excinfo:
        grpo.main(lora_args("grpo", tmp_path / "x", num_steps=2, lora_rank=0, resume=with_lora))
    one_line(excinfo)
    with pytest.raises(UsageError, match="was run with --lora-rank 0, not 4") as excinfo:
        grpo.main(lora_args("grpo", tmp_path / "y", num_steps=2, resume=without))
    one_line(excinfo)


def test_torchrun_and_missing_peft_get_one_line(tmp_path, monkeypatch):
    args = lora_args("grpo", tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "peft", None)  # as if not installed
    with pytest.raises(UsageError, match="needs peft, which is not installed: pip install -r requirements/lora.txt"):
        lora.check_args(args)
    monkeypatch.undo()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="--lora-rank under torchrun is not supported: .*FSDP2") as excinfo:
        lora.check_args(args)
    one_line(excinfo)


@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_verify_against_self_passes_on_a_lora_dump(script, tmp_path, capsys):
    """verify.py rebuilds the run's initial LoRA model from the dump's flags (the adapters are drawn from --seed)
    and replays it: every check passes, GRPO's update and weight checks on steps 2 and 3 included."""
    import verify

    SCRIPTS[script].main(
        lora_args(script, tmp_path, num_steps=3 if script == "grpo" else 1, dump_dir=str(tmp_path / "d"))
    )
    assert verify.main([str(tmp_path / "d"), "--against", "self"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[-1].startswith("PASS: ") and "| gradient |" in table
    if script == "grpo":
        assert "| update | 1,2 |" in table and "| log-probs | 1,2,3 |" in table
