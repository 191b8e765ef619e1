"""Real-model code paths: small Qwen2 and Llama models saved with save_pretrained (with a byte-level tokenizer
that has a chat template) and loaded back through exactly the code a hub model goes through.

Loading, the chat template, dropout off, a reward model with its own tokenizer, the saved outputs reloading,
gradient checkpointing off during generation, --dtype on a CPU, and the critic starting from the policy.
"""

import json
import math
import os
import string
import sys

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

import common
import grpo
import ppo
from machinery import flags, generation, learnt_reward, models, precision
from machinery.errors import UsageError
from machinery.tiny_model import TINY_CHARS, TINY_MODEL

CPU = torch.device("cpu")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer():
    """A byte-level BPE with no merges (every UTF-8 byte one token), the special tokens of a chat template,
    and that template: Qwen2.5-Instruct's layout with 259 tokens."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def char_tokenizer(chat_template=None):
    """A different tokenizer: one token per printable character, with an unknown token, for the reward model."""
    specials = ["<pad>", "<unk>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(string.printable))}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def small_config(arch, vocab_size, **overrides):
    shape = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=None,
    )
    shape.update(overrides)
    return {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch](**shape)


def save_causal_lm(folder, arch):
    """A random Qwen2 (tied embeddings, like Qwen2.5-0.5B) or Llama (untied) causal LM and a chat tokenizer."""
    tokenizer = byte_tokenizer()
    end, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = small_config(arch, len(tokenizer), tie_word_embeddings=arch == "qwen2", eos_token_id=end, pad_token_id=pad)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = [end, pad]  # like Qwen2.5-Instruct: two ids end a completion
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def lm(request, models_dir):
    """(folder, in-memory model, in-memory tokenizer) of a saved small causal LM, one per architecture."""
    folder = str(models_dir / request.param)
    model, tokenizer = save_causal_lm(folder, request.param)
    return folder, model, tokenizer


@pytest.fixture(scope="module")
def qwen2_dir(models_dir):
    folder = str(models_dir / "qwen2-only")
    save_causal_lm(folder, "qwen2")
    return folder


@pytest.fixture(scope="module")
def jsonl_task(models_dir):
    """Prompts with letters, spaces and digits: the byte-level tokenizer reads any text."""
    path = models_dir / "questions.jsonl"
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(4) for b in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"jsonl:{path}"


def run_dir_of(output_dir):
    (name,) = os.listdir(output_dir)
    return os.path.join(output_dir, name)


# ---------------------------------------------------------------------------------------------------
# Loading: the same AutoTokenizer / AutoModel path as a hub model.
# ---------------------------------------------------------------------------------------------------


def test_load_tokenizer_and_causal_lm_give_back_what_was_saved(lm):
    folder, model, tokenizer = lm
    loaded_tokenizer = models.load_tokenizer(folder)
    text = "What is 12 plus 7? Héllo, wörld!\n"
    assert loaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded_tokenizer.decode(loaded_tokenizer(text)["input_ids"]) == text
    assert loaded_tokenizer.padding_side == "left" and loaded_tokenizer.pad_token == "<|endoftext|>"
    assert loaded_tokenizer.chat_template == CHAT_TEMPLATE
    loaded = models.load_causal_lm(folder, CPU)
    assert type(loaded) is type(model) and loaded.dtype == torch.float32
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    eos_ids = models.eos_token_ids(loaded, loaded_tokenizer)
    assert sorted(eos_ids) == sorted(tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))


def test_tiny_tokenizer_reads_its_characters_and_nothing_else(tiny_tokenizer):
    """The built-in tiny model is a qwen2 whose tokenizer is character-level: it must not be rebuilt as
    Qwen's byte-level BPE on loading, which drops the space and every unknown character without a trace."""
    ids = tiny_tokenizer(TINY_CHARS, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TINY_CHARS) and tiny_tokenizer.decode(ids) == TINY_CHARS
    assert tiny_tokenizer.unk_token_id in tiny_tokenizer("Using 1", add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------------
# The chat template.
# ---------------------------------------------------------------------------------------------------


def test_encode_prompts_applies_the_chat_template_or_not(lm):
    folder, _, tokenizer = lm
    loaded = models.load_tokenizer(folder)
    prompts = ["12+3=", "What is 2 plus 2?"]
    with_template = generation.encode_prompts(loaded, prompts, chat_template=True)
    expected = tokenizer(f"<|im_start|>user\n{prompts[1]}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert with_template["input_ids"][1].tolist() == expected
    assert expected[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    short = with_template["input_ids"][0][with_template["attention_mask"][0].bool()].tolist()
    assert short == tokenizer(f"<|im_start|>user\n{prompts[0]}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert with_template["input_ids"][0, 0] == tokenizer.pad_token_id  # left padded
    raw = generation.encode_prompts(loaded, prompts, chat_template=False)
    assert raw["input_ids"][1].tolist() == tokenizer(prompts[1])["input_ids"]
    assert raw["input_ids"][0][raw["attention_mask"][0].bool()].tolist() == tokenizer(prompts[0])["input_ids"]


@pytest.mark.parametrize("chat_template, system_prompt", [(True, None), (False, None), (True, "Be brief."), (True, "")])
def test_grpo_feeds_the_template_to_the_model(qwen2_dir, jsonl_task, tmp_path, chat_template, system_prompt):
    args = grpo.Args(
        model=qwen2_dir,
        task=jsonl_task,
        num_steps=1,
        max_new_tokens=4,
        prompts_per_step=2,
        group_size=2,
        micro_batch_size=4,
        sample_every=0,
        chat_template=chat_template,
        output_dir=str(tmp_path / "runs"),
        dump_dir=str(tmp_path / "dump"),
        system_prompt=system_prompt,
    )
    grpo.main(args)
    from safetensors.torch import load_file

    batch = load_file(str(tmp_path / "dump" / "step000001.safetensors"))
    tokenizer = AutoTokenizer.from_pretrained(qwen2_dir)
    text = tokenizer.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()])
    system = "" if system_prompt is None else f"<|im_start|>system\n{system_prompt}<|im_end|>\n"
    if chat_template:
        assert text.startswith(f"{system}<|im_start|>user\nWhat is ") and text.endswith(
            "?<|im_end|>\n<|im_start|>assistant\n"
        )
    else:
        assert text.startswith("What is ") and text.endswith("?") and "<|im_start|>" not in text


def test_a_system_prompt_is_counted_and_one_the_template_refuses_is_named(tmp_path):
    """The prompt-length check counts the system turn as generation writes it; a template that takes no system
    turn (Gemma's raises) is refused in one line naming the flag."""
    tokenizer = byte_tokenizer()
    plain = models.token_counts(tokenizer, ["What is 1 plus 2?"], chat_template=True)[0]
    tokenizer.system_prompt = "Be brief."
    assert models.token_counts(tokenizer, ["What is 1 plus 2?"], True)[0] == plain + len(
        tokenizer("<|im_start|>system\nBe brief.<|im_end|>\n")["input_ids"]
    )
    assert models.token_counts(tokenizer, ["What is 1 plus 2?"], False)[0] == len(
        tokenizer("What is 1 plus 2?")["input_ids"]
    )
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}x"
    )
    with pytest.raises(
        UsageError, match=r"takes no system prompt \(TemplateError: System role not supported\): drop --system-prompt"
    ):
        generation.encode_prompts(tokenizer, ["What is 1 plus 2?"])
    tokenizer.system_prompt = None
    assert generation.encode_prompts(tokenizer, ["What is 1 plus 2?"])["input_ids"].tolist() == [
        tokenizer("x")["input_ids"]
    ]


def test_system_prompt_flag_parses_empty_and_text(monkeypatch):
    for argv, expected in [([], None), (["--system-prompt", ""], ""), (["--system-prompt", "Be brief."], "Be brief.")]:
        monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
        assert flags.parse_args(grpo.Args, grpo.HUB_DEFAULTS)[0].system_prompt == expected


# ---------------------------------------------------------------------------------------------------
# Whole runs on the saved models, and what they save.
# ---------------------------------------------------------------------------------------------------


def test_grpo_runs_on_a_saved_model_and_its_final_model_generates(lm, jsonl_task, tmp_path):
    folder, _, _ = lm
    args = grpo.Args(
        model=folder,
        task=jsonl_task,
        num_steps=2,
        max_new_tokens=4,
        prompts_per_step=2,
        group_size=2,
        micro_batch_size=4,
        sample_every=0,
        output_dir=str(tmp_path),
    )
    rewards = grpo.main(args)
    assert len(rewards) == 2 and all(0 <= r <= 1 for r in rewards)
    assert args.learning_rate == grpo.HUB_DEFAULTS["learning_rate"]  # a model other than tiny gets the hub preset
    final = os.path.join(run_dir_of(tmp_path), "final")
    tokenizer, model = AutoTokenizer.from_pretrained(final), AutoModelForCausalLM.from_pretrained(final)
    tokenizer.padding_side = "left"
    eos_ids = models.eos_token_ids(model, tokenizer)
    _, _, completion_ids, completion_mask = generation.generate(
        model, tokenizer, ["What is 1 plus 1?"], 4, 1.0, eos_ids
    )
    assert completion_ids.shape == (1, 4) or completion_mask[0, -1] == 1  # 4 tokens, or fewer ending in EOS
    assert completion_mask.sum() >= 1
    assert isinstance(generation.decode_completions(tokenizer, completion_ids, completion_mask, eos_ids)[0], str)


@pytest.mark.exact
def test_ppo_runs_on_a_saved_model_and_its_critic_reloads(lm, jsonl_task, tmp_path):
    folder, _, tokenizer = lm
    args = ppo.Args(
        model=folder,
        task=jsonl_task,
        num_steps=2,
        max_new_tokens=4,
        prompts_per_step=2,
        samples_per_prompt=2,
        micro_batch_size=4,
        update_epochs=1,
        num_minibatches=2,
        sample_every=0,
        output_dir=str(tmp_path),
    )
    scores = ppo.main(args)
    assert len(scores) == 2
    assert args.kl_coef == ppo.HUB_DEFAULTS["kl_coef"]
    run_dir = run_dir_of(tmp_path)
    backbone = AutoModel.from_pretrained(os.path.join(run_dir, "critic"))  # an ordinary transformers folder
    critic = ppo.load_critic(os.path.join(run_dir, "critic"), CPU)
    assert critic.value_head.weight.shape == (1, 32)
    for name, param in backbone.named_parameters():
        assert torch.equal(param, dict(critic.backbone.named_parameters())[name]), name
    ids = torch.tensor([tokenizer("What is 1 plus 1?")["input_ids"]])
    with torch.no_grad():
        assert critic(ids, torch.ones_like(ids)).shape == ids.shape
    final = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "final"))
    assert final.config.model_type == AutoModelForCausalLM.from_pretrained(folder).config.model_type


# ---------------------------------------------------------------------------------------------------
# Dropout is off after loading, so the ratio is exactly 1 before any update.
# ---------------------------------------------------------------------------------------------------

DROPOUT_CONFIGS = {
    "qwen2-attention_dropout": lambda: small_config("qwen2", 64, attention_dropout=0.5, pad_token_id=0, eos_token_id=1),
    "gpt2-pdrop": lambda: GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.5,
        embd_pdrop=0.5,
        attn_pdrop=0.5,
        bos_token_id=None,
    ),
    "gpt_neox-hidden_dropout": lambda: GPTNeoXConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout=0.5,
        attention_dropout=0.5,
    ),
    "bert-hidden_dropout_prob": lambda: BertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        is_decoder=True,
        hidden_dropout_prob=0.5,
        attention_probs_dropout_prob=0.5,
    ),
}


@pytest.mark.exact
@pytest.mark.parametrize("name", DROPOUT_CONFIGS)
def test_load_pretrained_turns_dropout_off(name, tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(DROPOUT_CONFIGS[name]()).save_pretrained(tmp_path)
    ids = torch.randint(2, 64, (2, 12))
    mask = torch.ones_like(ids)

    raw = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    assert not torch.equal(raw(ids, attention_mask=mask).logits, raw(ids, attention_mask=mask).logits)  # dropout is on

    model = models.load_pretrained(AutoModelForCausalLM, str(tmp_path), CPU).train()
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(v == 0 for k, v in vars(model.config).items() if "dropout" in k and isinstance(v, float))
    torch.testing.assert_close(
        model(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits, rtol=0, atol=0
    )
    if not name.startswith("bert"):  # the PPO ratio of two train-mode passes is exactly 1
        completion_mask = torch.ones(2, 4, dtype=torch.long)
        logp = common.token_logprobs(model, ids, mask, completion_mask, 1.0)
        old_logp = common.token_logprobs(model, ids, mask, completion_mask, 1.0)
        assert torch.equal(torch.exp(logp - old_logp), torch.ones_like(logp))


# ---------------------------------------------------------------------------------------------------
# A reward model with a tokenizer of its own.
# ---------------------------------------------------------------------------------------------------

RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def save_reward_model(folder, num_labels=1, chat_template=None):
    tokenizer = char_tokenizer(chat_template)
    config = small_config("qwen2", len(tokenizer), num_labels=num_labels, initializer_range=0.2)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


@pytest.fixture(scope="module", params=[None, RM_TEMPLATE], ids=["no-template", "template"])
def reward_model(request, models_dir):
    folder = str(models_dir / f"reward-{request.param is not None}")
    model, tokenizer = save_reward_model(folder, chat_template=request.param)
    return folder, model, tokenizer


def test_reward_model_scores_the_retokenised_text(reward_model):
    folder, model, tokenizer = reward_model
    scorer = learnt_reward.RewardModel(folder, CPU, torch.float32)
    prompts = ["What is 2 plus 2?", "12+3=", "x"]
    completions = [" 4, I think.", "15", ""]
    scores = scorer.score(prompts, completions, ["4", "15", ""])
    assert len(scores) == 3 and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert scorer.score(prompts, completions, ["4", "15", ""]) == scores  # deterministic
    assert len(set(scores)) == 3
    for prompt, completion, score in zip(prompts, completions, scores):  # one at a time, no padding
        if tokenizer.chat_template:
            text = f"[user] {prompt}\n[assistant] {completion}\n"
        else:
            text = prompt + completion
        with torch.no_grad():
            expected = model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-5)


def test_reward_model_with_two_outputs_is_a_usage_error(tmp_path):
    save_reward_model(str(tmp_path), num_labels=2)
    with pytest.raises(UsageError, match="has 2 outputs: a reward model has 1"):
        learnt_reward.RewardModel(str(tmp_path), CPU, torch.float32)


def test_grpo_runs_with_a_reward_model(qwen2_dir, jsonl_task, models_dir, tmp_path):
    folder = str(models_dir / "reward-for-grpo")
    save_reward_model(folder)
    args = grpo.Args(
        model=qwen2_dir,
        task=jsonl_task,
        reward_model=folder,
        num_steps=2,
        max_new_tokens=4,
        prompts_per_step=2,
        group_size=2,
        micro_batch_size=4,
        sample_every=0,
        output_dir=str(tmp_path),
    )
    rewards = grpo.main(args)
    assert len(rewards) == 2 and all(math.isfinite(r) for r in rewards)
    assert not set(rewards) <= {0.0, 1.0}  # scores of the reward model, not the task's exact-match reward


# ---------------------------------------------------------------------------------------------------
# Gradient checkpointing: off while generating, back on for training, same result.
# ---------------------------------------------------------------------------------------------------


def checkpointing_flags(model):
    return [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]


def test_generation_turns_gradient_checkpointing_off_and_back_on(qwen2_dir):
    model = models.load_causal_lm(qwen2_dir, CPU)
    tokenizer = models.load_tokenizer(qwen2_dir)
    precision.set_activation_checkpointing(model, True)
    model.train()
    assert any(checkpointing_flags(model))
    seen = []
    generate = model.generate

    def spy(*args, **kwargs):
        seen.append((model.is_activation_checkpointing, any(checkpointing_flags(model)), model.training))
        return generate(*args, **kwargs)

    model.generate = spy
    eos_ids = models.eos_token_ids(model, tokenizer)
    generation.generate(model, tokenizer, ["What is 1 plus 1?"], 4, 1.0, eos_ids)
    assert seen == [(False, False, False)]
    assert model.is_activation_checkpointing and all(checkpointing_flags(model)) and model.training


REWARD_FILE = """
EXAMPLES = [{"prompt": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(12)]


def reward(prompt, completion, answer):
    return (sum(map(ord, completion)) % 7) / 7  # varies between completions, so the advantages are not 0
"""


def test_grpo_with_gradient_checkpointing_trains_the_same(qwen2_dir, tmp_path):
    reward_file = tmp_path / "varied.py"
    reward_file.write_text(REWARD_FILE)
    finals = []
    for checkpointing in ("off", "on"):
        output_dir = tmp_path / f"runs-{checkpointing}"
        args = grpo.Args(
            model=qwen2_dir,
            task=f"python:{reward_file}:reward",
            num_steps=2,
            max_new_tokens=4,
            prompts_per_step=2,
            group_size=2,
            micro_batch_size=2,
            learning_rate=1e-3,
            sample_every=0,
            output_dir=str(output_dir),
            gradient_checkpointing=checkpointing,
        )
        assert len(grpo.main(args)) == 2
        finals.append(AutoModelForCausalLM.from_pretrained(os.path.join(run_dir_of(output_dir), "final")).state_dict())
    initial = AutoModelForCausalLM.from_pretrained(qwen2_dir).state_dict()
    assert max((finals[0][k] - initial[k]).abs().max().item() for k in initial) > 1e-4  # the run did train
    for key in initial:
        torch.testing.assert_close(finals[1][key], finals[0][key], rtol=0, atol=1e-6, msg=key)


# ---------------------------------------------------------------------------------------------------
# --dtype on a CPU, and the critic.
# ---------------------------------------------------------------------------------------------------


def test_float16_is_refused_before_anything_loads(qwen2_dir, tmp_path):
    """float16 without loss scaling lets small gradients underflow to 0: refused in one line, bfloat16 suggested."""
    with pytest.raises(UsageError, match="--dtype float16 would need loss scaling.*use --dtype bfloat16"):
        precision.resolve_dtype("float16", CPU)
    args = grpo.Args(model=qwen2_dir, dtype="float16", num_steps=1, output_dir=str(tmp_path))
    with pytest.raises(UsageError, match="float16"):
        grpo.main(args)
    assert not os.listdir(tmp_path)  # stopped before creating the run folder


@pytest.mark.exact
def test_a_saved_critic_reloads_with_its_value_head(lm, tmp_path):
    folder, _, _ = lm
    critic = ppo.load_critic(folder, CPU)
    torch.nn.init.normal_(critic.value_head.weight)
    torch.nn.init.normal_(critic.value_head.bias)
    critic.save_pretrained(str(tmp_path / "critic"))
    again = ppo.load_critic(str(tmp_path / "critic"), CPU)
    for (name, a), (_, b) in zip(critic.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.exact
def test_critic_starts_from_the_policy_weights(lm):
    folder, _, _ = lm
    policy = dict(models.load_causal_lm(folder, CPU).named_parameters())
    critic_model = ppo.load_critic(folder, CPU)
    critic = dict(critic_model.named_parameters())
    backbone = {name for name in critic if name.startswith("backbone.")}
    assert {name.removeprefix("backbone.") for name in backbone} == {
        name.removeprefix("model.") for name in policy if name.startswith("model.")
    }
    for name in backbone:
        policy_name = "model." + name.removeprefix("backbone.")
        assert torch.equal(critic[name], policy[policy_name]), name
        assert critic[name].data_ptr() != policy[policy_name].data_ptr()
    assert set(critic) - backbone == {"value_head.weight", "value_head.bias"}  # only the value head is new
    assert critic_model.value_head.weight.shape == (1, 32)
    assert not critic_model.value_head.weight.any() and not critic_model.value_head.bias.any()  # starts at zero


def test_the_lm_head_reads_a_contiguous_input_trainable_or_frozen():
    """With logits_to_keep the hidden states are a strided view, on which torch's matmul takes one kernel for a
    trainable weight and another for a frozen one (docs/testing.md): the head of every causal LM loaded, a trainable
    policy and its frozen reference alike, is given a contiguous copy, whatever kernel this CPU has."""
    from machinery import lora

    policy = models.load_causal_lm(TINY_MODEL, models.CPU)
    reference = lora.reference(policy, grpo.Args(), models.CPU)
    ids = torch.tensor([[4, 5, 17, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10, 11, 12]])  # two rows: a strided view
    for model, trainable in ((policy, True), (reference, False), (policy, False)):
        model.requires_grad_(trainable)
        seen = []
        hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        logits = model(input_ids=ids, logits_to_keep=3).logits
        hook.remove()
        assert [(x.shape[1], x.is_contiguous()) for x in seen] == [(3, True)]
        assert torch.equal(logits, model.get_output_embeddings()(seen[0].clone()))
