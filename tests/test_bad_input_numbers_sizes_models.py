"""Bad input, principles 1 to 3 of this file (docs/bad_input.md, one section a principle: "Done" means the run did
what was asked, impossible sizes are refused before anything is allocated, only a model that can be trained correctly
is trained): absurd finite numbers, impossible sizes, untrainable models. Principles 4 to 8:
test_bad_input_files_causes_processes.py.
"""

import dataclasses
import glob
import os
import time
import typing

import pytest
import torch
from test_bad_input_flags_and_state import run_with_flag

import grpo
import ppo
from machinery import flags as run_flags
from machinery import model_checks, models, startup
from machinery.errors import UsageError
from machinery.tiny_model import TINY_MODEL

SMALL = {grpo: dict(prompts_per_step=4, group_size=2), ppo: dict(prompts_per_step=4, num_minibatches=2)}


def small_args(module, tmp_path, **overrides):
    return module.Args(
        **{
            **dict(num_steps=1, max_new_tokens=3, sample_every=0, output_dir=os.path.join(tmp_path, "runs")),
            **SMALL[module],
            **overrides,
        }
    )


def numeric_flags(module):
    hints = typing.get_type_hints(module.Args)
    kinds = {f.name: {hints[f.name], *typing.get_args(hints[f.name])} for f in dataclasses.fields(module.Args)}
    return [(name, float if float in kind else int) for name, kind in kinds.items() if {int, float} & kind]


def final_weights(tmp_path):
    (final,) = glob.glob(str(tmp_path / "runs" / "*" / "final"))
    return models.load_causal_lm(final, models.CPU).state_dict()


# ---------------------------------------------------------------------------------------------------
# Principle 1: "done" means the run did what was asked.
# ---------------------------------------------------------------------------------------------------

EXTREMES = {float: ("1e-300", "1e308", "-1e308", str(2**63)), int: (str(2**63), str(-(2**63)))}
FUZZ = [(m, name, v) for m in (grpo, ppo) for name, kind in numeric_flags(m) for v in EXTREMES[kind]]


@pytest.mark.parametrize("module, name, value", FUZZ, ids=[f"{m.__name__} {n}={v}" for m, n, v in FUZZ])
def test_principle1_fuzz_every_numeric_flag_with_finite_extremes(module, name, value, tmp_path, monkeypatch):
    """Each numeric flag of both scripts at 1e-300, 1e308, -1e308 and 2**63 (ints: +-2**63), as typed: one line,
    raised before any model loads, or a run whose saved model is finite and moved from its start."""
    e, loads = run_with_flag(module, name, value, small_args(module, tmp_path), monkeypatch)
    if e is not None:
        assert "\n" not in str(e) and not loads and name.replace("_", "-") in str(e), (str(e), loads)
        return
    start, end = models.load_causal_lm(TINY_MODEL, models.CPU).state_dict(), final_weights(tmp_path)
    assert all(torch.isfinite(w).all() for w in end.values())
    assert any(not torch.equal(start[k], end[k]) for k in start), "done, but the weights did not move"


def test_principle1_fuzz_covers_every_numeric_flag():
    names = {name for module in (grpo, ppo) for name, _ in numeric_flags(module)}
    assert {
        "seed",
        "num_steps",
        "prompts_per_step",
        "group_size",
        "samples_per_prompt",
        "kl_horizon",
        "temperature",
        "max_grad_norm",
        "target_kl",
        "eval_every",
        "warmup_steps",
    } <= names
    assert len(FUZZ) >= 100


@pytest.mark.parametrize(
    "module, flags",
    [
        (grpo, dict(temperature=100.0)),
        (grpo, dict(learning_rate=1e-8)),
        (grpo, dict(max_grad_norm=1e-6)),
        (grpo, dict(beta=1e6)),
        (grpo, dict(clip_high=1e6, weight_decay=1e-30)),
        (ppo, dict(vf_coef=1e6)),
        (ppo, dict(missing_eos_penalty=1e6)),
        (ppo, dict(kl_coef=1e6, vf_coef=1e-30)),
    ],
)
def test_principle1_the_extremes_allowed_train(module, flags, tmp_path):
    """At the edges the checks allow, a step still moves the weights and keeps them finite. The reward (distinct
    characters written) differs between completions, so every step has something to learn, at any temperature."""
    (tmp_path / "r.py").write_text(
        "EXAMPLES = [{'prompt': f'{i}=', 'answer': str(i)} for i in range(20)]\n"
        "def f(p, c, a):\n    return float(len(set(c)))\n"
    )
    module.main(small_args(module, tmp_path, task=f"python:{tmp_path / 'r.py'}:f", **flags))
    start, end = models.load_causal_lm(TINY_MODEL, models.CPU).state_dict(), final_weights(tmp_path)
    assert all(torch.isfinite(w).all() for w in end.values())
    assert any(not torch.equal(start[k], end[k]) for k in start), f"{flags}: the weights did not move"


@pytest.mark.parametrize(
    "module, flags, expected",
    [
        (grpo, dict(temperature=1e-3), r"--temperature is 0\.001: use a value in \[0\.01, 100\]"),
        (grpo, dict(temperature=1e3), r"--temperature is 1000\.0: use a value in \[0\.01, 100\]"),
        (grpo, dict(max_grad_norm=1e-7), r"--max-grad-norm is 1e-07: it must be at least 1e-6"),
        (grpo, dict(learning_rate=1e-9), r"--learning-rate is 1e-09: it must be at least 1e-8"),
        (ppo, dict(critic_learning_rate=1e-9), r"--critic-learning-rate is 1e-09: it must be at least 1e-8"),
        (grpo, dict(beta=1e-300), r"--beta is 1e-300: float32 reads it as 0; pass 0, or a value of at least 1e-30"),
        (ppo, dict(kl_coef=1e39), r"--kl-coef is 1e\+39: it must be at most 1e6 in size"),
        (grpo, dict(dump_dir=""), r"--dump-dir is empty: pass a folder to dump into, or leave the flag out"),
    ],
)
def test_principle1_lines(module, flags, expected, tmp_path):
    with pytest.raises(UsageError, match=expected):
        module.check_args(small_args(module, tmp_path, **flags))


# ---------------------------------------------------------------------------------------------------
# Principle 2: impossible sizes are refused before anything is allocated.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, flags, biggest",
    [
        (grpo, dict(prompts_per_step=10**9), "the generation's KV cache"),
        (grpo, dict(group_size=10**8), "the generation's KV cache"),
        (ppo, dict(prompts_per_step=10**9), "the generation's KV cache"),
        (ppo, dict(samples_per_prompt=10**8, num_minibatches=1, micro_batch_size=10**8), "the generation's KV cache"),
        (grpo, dict(max_new_tokens=10**9), "the generation's KV cache"),
    ],
)
def test_principle2_impossible_sizes_are_refused_with_the_numbers(module, flags, biggest, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    started = time.monotonic()
    with pytest.raises(
        UsageError,
        match=rf"a step needs at least [\d,.e+]+ GiB \({biggest}: [\d,.e+]+ GiB\), more "
        r"than the [\d,.]+ GiB of memory \(RAM\): lower --prompts-per-step",
    ):
        module.main(small_args(module, tmp_path, **flags))
    assert time.monotonic() - started < 30  # refused from the flags and the config, nothing sampled


def tiny_qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )


def test_principle2_step_bytes_counts_by_hand():
    """step_bytes against the count written out for a 2-layer model (vocab 10, hidden 8, 2 heads of 4, one KV head,
    MLP 16, an output head of its own), and its parts under each flag that drops or shrinks a model."""
    config = tiny_qwen2()
    layer = (8 * 8 + 8) + 2 * (8 * 4 + 4) + 8 * 8 + 3 * 8 * 16 + 2 * 8  # q, k and v (biased), o, MLP, 2 norms
    backbone = 10 * 8 + 2 * layer + 8  # embedding, layers, final norm
    params = backbone + 10 * 8  # and the output head
    args = grpo.Args(prompts_per_step=3, group_size=2, max_new_tokens=4, micro_batch_size=8, beta=0.1)
    need, parts = model_checks.step_bytes(args, config)
    assert parts["the policy's weights and optimizer state"] == 16 * params  # weight, gradient, AdamW's two moments
    assert parts["the reference's weights"] == 4 * params
    assert parts["the generation's KV cache"] == 6 * 5 * 2 * 2 * 4 * 2  # rows, positions, layers, k and v, kv dim, bf16
    assert parts["the generation's logits"] == 6 * 10 * 4
    # a micro-batch of 8 holds the 6 rows there are, of 4 completion tokens: each layer's input (hidden 8, bf16), and
    # their float32 logits, all 24 positions in one chunk (CHUNK_TOKENS is 1024)
    assert parts["a micro-batch's layer inputs"] == 6 * 4 * 2 * 8 * 2
    assert parts["a chunk's logits"] == 6 * 4 * 10 * 4
    long = model_checks.step_bytes(grpo.Args(prompts_per_step=3, group_size=2, max_new_tokens=512, beta=0.1), config)
    assert long[1]["a chunk's logits"] == 1024 * 10 * 4  # 6 x 512 positions, computed 1024 at a time
    assert need == sum(parts.values())
    assert model_checks.step_bytes(grpo.Args(beta=0.0), config)[1]["the reference's weights"] == 0
    adapters = 2 * 16 * ((8 + 8) + 2 * (8 + 4) + (8 + 8) + 2 * (8 + 16) + (16 + 8))  # rank 16 on each linear layer
    lora = model_checks.step_bytes(grpo.Args(lora_rank=16), config)[1]
    assert lora["the policy's weights and optimizer state"] == 4 * params + 16 * adapters  # the base frozen
    assert lora["the reference's weights"] == 0  # the policy with its adapters off
    critic = model_checks.step_bytes(ppo.Args(), config)[1]["the critic's weights and optimizer state"]
    assert critic == 16 * (backbone + 8 + 1)  # no output head; a value head
    assert "the critic's weights and optimizer state" not in model_checks.step_bytes(ppo.Args(vf_coef=0.0), config)[1]
    assert model_checks.step_bytes(ppo.Args(kl_coef=0.0), config)[1]["the reference's weights"] == 0
    full = model_checks.step_bytes(ppo.Args(), config)[1]
    sharded = model_checks.step_bytes(ppo.Args(), config, world_size=2)[1]
    for key in (
        "the policy's weights and optimizer state",
        "the reference's weights",
        critic_key := "the critic's weights and optimizer state",
    ):
        assert sharded[key] == full[key] // 2  # FSDP: each process holds half of every model
    assert critic_key in sharded


def test_principle2_step_bytes_per_process_and_under_lora():
    """Under torchrun each process generates and trains on its own rows: 4 prompts x 3 samples on 2 processes are 6
    rows a process (its micro-batch of 8 holds those 6). A LoRA critic, like the LoRA policy, has its backbone frozen
    (4 bytes a parameter) and its adapters and value head trained (16)."""
    config = tiny_qwen2()
    for module, samples in ((grpo, dict(group_size=3)), (ppo, dict(samples_per_prompt=3))):
        args = module.Args(prompts_per_step=4, max_new_tokens=4, micro_batch_size=8, **samples)
        parts = model_checks.step_bytes(args, config, world_size=2)[1]
        assert parts["the generation's KV cache"] == 6 * 5 * 2 * 2 * 4 * 2  # rows, positions, layers, k v, kv dim, bf16
        assert parts["the generation's logits"] == 6 * 10 * 4
        assert parts["a micro-batch's layer inputs"] == 6 * 4 * 2 * 8 * 2  # tokens, layers, hidden, bf16
        assert parts["a chunk's logits"] == 6 * 4 * 10 * 4  # the micro-batch's 24 positions: one chunk
    layer = (8 * 8 + 8) + 2 * (8 * 4 + 4) + 8 * 8 + 3 * 8 * 16 + 2 * 8
    backbone = 10 * 8 + 2 * layer + 8
    adapters = 2 * 16 * ((8 + 8) + 2 * (8 + 4) + (8 + 8) + 2 * (8 + 16) + (16 + 8))  # rank 16 on each linear layer
    critic = model_checks.step_bytes(ppo.Args(lora_rank=16), config)[1]["the critic's weights and optimizer state"]
    assert critic == 4 * backbone + 16 * adapters + 16 * (8 + 1)


def test_principle2_the_parameters_counted_are_the_models_own():
    """The skeleton's count against the parameters of the model itself, built on the CPU (an independent count),
    for a policy, a critic's backbone, and a GPT-2 (no gated MLP, Conv1D layers)."""
    from transformers import AutoModel, AutoModelForCausalLM, GPT2Config

    for config in (tiny_qwen2(), GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=10, n_positions=8)):
        for backbone, loader in ((False, AutoModelForCausalLM), (True, AutoModel)):
            real = sum(p.numel() for p in loader.from_config(config).parameters())
            assert sum(p.numel() for p in model_checks.skeleton(config, backbone).parameters()) == real


def test_principle2_a_critic_model_of_another_size_is_counted_from_its_config():
    small, large = tiny_qwen2(), tiny_qwen2()
    large.hidden_size, large.intermediate_size = 16, 32
    own = model_checks.step_bytes(ppo.Args(), small)[1]["the critic's weights and optimizer state"]
    other = model_checks.step_bytes(ppo.Args(), small, critic_config=large)[1][
        "the critic's weights and optimizer state"
    ]
    backbone = sum(p.numel() for p in model_checks.skeleton(large, backbone=True).parameters())
    assert other == 16 * (backbone + 16 + 1) > own


def qwen_config(folder, **sizes):
    from transformers import Qwen2Config

    config = Qwen2Config(architectures=["Qwen2ForCausalLM"], max_position_embeddings=32768, **sizes)
    config.save_pretrained(folder)
    return str(folder)


QWEN_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
QWEN_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)


def test_principle2_lora_on_qwen2_5_1_5b_fits_this_machine_and_7b_an_80gb_gpu(tmp_path):
    """The issue's bar: `grpo.py --model <Qwen2.5-1.5B's config> --lora-rank 16 --prompts-per-step 1 --group-size 2
    --max-new-tokens 8 --micro-batch-size 1` passes the check on a 23.5 GiB machine (it needs 6.0 GiB: 1.54B frozen
    parameters at 4 bytes, 18M adapter parameters at 16), and the README's `grpo.py --model
    Qwen/Qwen2.5-7B-Instruct --lora-rank 16` (HUB_DEFAULTS) needs 34.9 GiB, within an 80 GB GPU; without LoRA the 7B
    step needs 148 GiB, refused there."""
    import tyro
    from transformers import AutoConfig

    folder = qwen_config(tmp_path / "q15", **QWEN_1_5B)
    line = (
        f"--model {folder} --lora-rank 16 --prompts-per-step 1 --group-size 2 --max-new-tokens 8 --micro-batch-size 1"
    )
    args = tyro.cli(grpo.Args, args=line.split())
    run_flags.apply_hub_defaults(args, grpo.HUB_DEFAULTS, {"max_new_tokens", "micro_batch_size"})
    need = model_checks.step_bytes(args, AutoConfig.from_pretrained(folder))[0]
    assert 5.5 * 2**30 < need < 6.5 * 2**30
    fake = type("Device", (), {"type": "cpu"})()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_checks, "machine_memory", lambda device: int(23.5 * 2**30))
        model_checks.check_step_fits(args, AutoConfig.from_pretrained(folder), fake)
        args.lora_rank = 0
        with pytest.raises(UsageError, match=r"the policy's weights and optimizer state: .*: train LoRA adapters"):
            model_checks.check_step_fits(args, AutoConfig.from_pretrained(folder), fake)
    seven = AutoConfig.from_pretrained(qwen_config(tmp_path / "q7", **QWEN_7B))
    args = grpo.Args(model="Qwen/Qwen2.5-7B-Instruct", task="gsm8k", lora_rank=16, learning_rate=1e-5)
    run_flags.apply_hub_defaults(args, grpo.HUB_DEFAULTS, {"learning_rate"})
    assert model_checks.step_bytes(args, seven)[0] < 80e9 * 0.5
    args.lora_rank = 0
    assert model_checks.step_bytes(args, seven)[0] > 141e9


MEASURED = [
    ("grpo", dict(lora_rank=16)),
    ("grpo", dict(beta=0.0)),
    ("ppo", dict(vf_coef=0.0)),
    ("ppo", dict(lora_rank=16)),
    ("grpo", dict(max_new_tokens=160, gradient_checkpointing="on")),  # 8 x 160 positions: the head a chunk at a time
]
MEASURE = """
import json, resource, sys
import grpo, ppo, peft, safetensors.torch, torch.utils.tensorboard  # imported before the baseline
from transformers import AutoConfig
from machinery import model_checks, models
module = {"grpo": grpo, "ppo": ppo}[sys.argv[1]]
args = module.Args(**json.loads(sys.argv[2]))
need = model_checks.step_bytes(args, AutoConfig.from_pretrained(models.resolve_model_path(args.model)))[0]
resident = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()  # now, not the peak so far
module.main(args)
print(json.dumps([need, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - resident]))
"""


@pytest.fixture(scope="module")
def model_of_42m(tmp_path_factory):
    """A 42.5M-parameter Qwen2 (hidden 768, 6 layers) with the tiny model's tokenizer: its weights (170 MB) dwarf
    what the Python process allocates besides, so a peak measured in RSS is mostly what the step holds."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("m42")
    config = Qwen2Config(
        vocab_size=25,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    models.load_tokenizer(TINY_MODEL).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
@pytest.mark.parametrize("script, flags_", MEASURED, ids=[f"{s} {f}" for s, f in MEASURED])
def test_principle2_the_bound_is_below_the_measured_peak(script, flags_, model_of_42m, tmp_path):
    """One step on the 42M model in a fresh process: the peak resident memory it adds (ru_maxrss at the end, less
    the resident memory after the imports) is above step_bytes, and at most 3 times it (6 under LoRA). Measured
    (bound / peak added, MiB): LoRA GRPO 184 / 390 (2.1x: loading holds a second copy of the frozen weights a
    while; 184 / 903, 4.9x, once inside the whole suite's run, where the allocator kept more of that copy); --beta 0
    649 / 786 (1.2x); PPO --vf-coef 0 811 / 946 (1.2x); LoRA PPO 367 / 674 (1.8x)."""
    import json
    import subprocess
    import sys

    sizes = dict(group_size=2) if script == "grpo" else dict(num_minibatches=2)
    args = dict(model=model_of_42m, num_steps=1, prompts_per_step=4, max_new_tokens=4, sample_every=0, **sizes)
    args.update(flags_, output_dir=str(tmp_path / "runs"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, script, json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    bound, peak = json.loads(run.stdout.splitlines()[-1])
    assert bound < peak < (6 if flags_.get("lora_rank") else 3) * bound, (bound, peak)


def test_principle2_the_defaults_fit():
    for module in (grpo, ppo):
        config = models.from_pretrained(__import__("transformers").AutoConfig, models.resolve_model_path("tiny"))
        model_checks.check_step_fits(module.Args(), config, models.CPU)


# ---------------------------------------------------------------------------------------------------
# Principle 3: only a model that can be trained correctly is trained.
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_parts():
    return models.load_causal_lm(TINY_MODEL, models.CPU), models.load_tokenizer(TINY_MODEL)


def save_bert(folder, head):
    from transformers import BertConfig, BertLMHeadModel, BertModel

    config = BertConfig(vocab_size=25, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    (BertLMHeadModel if head else BertModel)(config).save_pretrained(folder)
    models.load_tokenizer(TINY_MODEL).save_pretrained(folder)
    return str(folder)


def test_principle3_a_bert_lm_head_and_a_bert_critic_are_refused(tmp_path):
    with pytest.raises(UsageError, match=r"\(BertLMHeadModel\) is not causal: a later token changes the output"):
        models.load_causal_lm(save_bert(tmp_path / "lm", head=True), models.CPU)
    with pytest.raises(UsageError, match=r"--critic-model '.*critic' \(BertModel\) is not causal"):
        ppo.main(small_args(ppo, tmp_path, critic_model=save_bert(tmp_path / "critic", head=False)))


def test_principle3_the_causal_probe_is_one_forward(tiny_parts, monkeypatch):
    model = tiny_parts[0]
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    monkeypatch.setattr(model_checks, "CHECKED", set())
    model_checks.check_causal_and_finite(model, "x")
    model_checks.check_causal_and_finite(model, "x")  # once a model
    assert calls == [1]


def test_principle3_nan_weights_are_named(tiny_parts, tmp_path):
    model, tokenizer = tiny_parts
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight[3, 4] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    tokenizer.save_pretrained(tmp_path / "nan")
    with pytest.raises(UsageError, match=r"its weight model\.layers\.2\.mlp\.up_proj\.weight holds NaN or inf"):
        models.load_causal_lm(str(tmp_path / "nan"), models.CPU)


def test_principle3_token_ids_outside_the_embeddings(tiny_parts):
    model, tokenizer = tiny_parts
    tokenizer.add_tokens([f"extra{i}" for i in range(5)])
    with pytest.raises(UsageError, match=r"has 30 tokens, but its model embeds only 25"):
        models.eos_token_ids(model, tokenizer)
    model.generation_config.eos_token_id = 99
    with pytest.raises(UsageError, match=r"the EOS id 99 of .* is outside its 25 embeddings"):
        models.eos_token_ids(model, models.load_tokenizer(TINY_MODEL))


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{{ raise_exception('no system prompt') }}", r"the chat template of 't' raised \w+ \(no system prompt\) on a"),
        ("=", r"the chat template of 't' drops the message: 'Probe 7 \+ 5 = \?' renders as '='"),
        ("{{ messages[0]['contnet'] }}", r"the chat template of 't' drops the message"),
    ],
)
def test_principle3_a_chat_template_that_raises_or_drops_the_message(tiny_parts, template, expected):
    tokenizer = tiny_parts[1]
    tokenizer.chat_template = template
    with pytest.raises(UsageError, match=expected):
        model_checks.check_chat_template(tokenizer, "t", chat_template=True)
    model_checks.check_chat_template(tokenizer, "t", chat_template=False)  # --no-chat-template: not used


TEMPLATES = {  # chat templates for the tiny tokenizer: one that takes a system turn, and two that do not
    "takes": "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}",
    "drops": "{% for m in messages %}{% if m['role'] != 'system' %}{{ m['content'] }};{% endif %}{% endfor %}",
    "raises": "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    "{{ m['content'] }}{% endfor %}",
}


def tiny_with_template(folder, template):
    import shutil

    shutil.copytree(models.resolve_model_path(TINY_MODEL), folder)
    tokenizer = models.load_tokenizer(str(folder))
    tokenizer.chat_template = TEMPLATES[template]
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    "template, system, expected",
    [
        (None, "Be brief.", r"--system-prompt goes into the chat template's system turn, and 'tiny' has none: drop"),
        ("drops", "Be brief.", r"the chat template of '.*' leaves the system turn out \('Probe system 3 \* 4' renders"),
        ("raises", "Be brief.", r"the chat template of '.*' takes no system turn \(it raised \w+: no system\)"),
        (
            "takes",
            "x" * 100_000,
            r"--system-prompt is 100,000 characters, more than the 256 positions of '.*' can hold",
        ),
        ("takes", "x" * 250, r"--system-prompt is 2\d\d tokens in the chat template, and with --max-new-tokens 5 more"),
    ],
)
def test_principle3_a_system_prompt_nothing_takes_or_too_long_is_refused_before_any_load(
    template, system, expected, tmp_path, monkeypatch
):
    """Checked once, from the tokenizer and config alone: a 100,000-character one used to be tokenized with each
    of the task's prompts, in one call that held off SIGTERM (no line in 120 s)."""
    model = tiny_with_template(tmp_path / "m", template) if template else TINY_MODEL
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    started = time.monotonic()
    with pytest.raises(UsageError, match=expected):
        startup.check_model_names(grpo.Args(model=model, system_prompt=system))
    assert time.monotonic() - started < 10
    if template == "takes":
        startup.check_model_names(grpo.Args(model=model, system_prompt="x" * 100))  # fits: accepted


def test_principle3_prompts_are_tokenized_a_bounded_amount_a_call(tiny_tokenizer, monkeypatch):
    """A signal is handled between calls into the tokenizer (native code holds it off): each call gets about
    `chunk_chars` characters, one text at least."""
    sizes, real = [], type(tiny_tokenizer).__call__
    monkeypatch.setattr(
        type(tiny_tokenizer), "__call__", lambda self, texts, **k: sizes.append(len(texts)) or real(self, texts, **k)
    )
    counts = models.token_counts(tiny_tokenizer, ["12"] * 10 + ["3" * 50], chat_template=False, chunk_chars=20)
    made = list(sizes)  # the calls below are not token_counts'
    assert counts == [len(tiny_tokenizer("12")["input_ids"])] * 10 + [len(tiny_tokenizer("3" * 50)["input_ids"])]
    assert made == [10, 1]


def documented_rows(heading):
    """(script, flags, line) of each `python SCRIPT.py FLAGS` row of a section of docs/bad_input.md."""
    import re

    text = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "bad_input.md")).read()
    section = text.split(f"## {heading}")[1].split("\n## ")[0]
    return re.findall(r"^\| `python (grpo|ppo)\.py ([^`]*)`[^|]* \| `error: (.*)` \|$", section, re.M)


@pytest.mark.parametrize(
    "heading, exact",
    [
        ('"Done" means the run did what was asked', True),
        ("Impossible sizes are refused before anything is allocated", False),
    ],
)
def test_the_documented_lines_are_the_lines(heading, exact, monkeypatch):
    """Each row of the two tables, run through the checks that come before any load: exactly its line (principle
    2's sizes in GiB are this machine's, so any number stands for a number there)."""
    import re
    import shlex

    import tyro

    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    rows = documented_rows(heading)
    assert len(rows) >= 4
    for script, flags, line in rows:
        module = {"grpo": grpo, "ppo": ppo}[script]
        args = tyro.cli(module.Args, args=shlex.split(flags.split(" (")[0]))
        with pytest.raises(UsageError) as error:
            module.check_args(args)
            startup.check_model_names(args)
        parts = [line] if exact else re.split(r"\d[\d,.]*\d|\d", line)
        expected = r"(?:\d[\d,.]*\d|\d)".join(map(re.escape, parts))  # one part, or numbers between parts
        assert re.fullmatch(expected, str(error.value)), (flags, str(error.value))
