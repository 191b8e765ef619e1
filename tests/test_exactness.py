"""Exact on every model: the deviations an audit found at the edges, each pinned by a test that failed before.

The log-probs of every architecture are in test_architectures.py; here: the reference at step 1 under bfloat16,
one BOS for the reward model, what the reward sees of a completion, float16, weight decay and the value head.
"""

import pytest
import torch
from test_reproducibility import logged_scalars, only_run_dir
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tokenizer_models
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast, Qwen2Config

import common
import grpo
import ppo
from machinery import errors, generation, learnt_reward, models, precision
from tasks import rewards

CPU = torch.device("cpu")


@pytest.mark.exact
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_the_reference_equals_the_policy_at_step_1_in_bfloat16(script, tmp_path):
    """The reference was held in bf16 while the policy kept float32 weights under bf16 autocast: with the same
    weights their log-probs differed (max 0.005 per token) and step 1 logged a KL > 0. Now it is exactly 0."""
    module = {"grpo": grpo, "ppo": ppo}[script]
    extra = (
        dict(beta=0.04, group_size=4)
        if script == "grpo"
        else dict(kl_coef=0.05, missing_eos_penalty=0.0, update_epochs=1, num_minibatches=1)
    )
    args = module.Args(
        seed=3, num_steps=1, prompts_per_step=8, dtype="bfloat16", sample_every=0, output_dir=str(tmp_path), **extra
    )
    module.main(args)
    scalars = logged_scalars(only_run_dir(tmp_path))
    assert scalars["losses/kl_ref"] == [(1, 0.0)]
    if script == "ppo":  # the reward is the score alone: no KL penalty at step 1 (and no missing-EOS penalty here)
        assert scalars["charts/reward"][0][1] == pytest.approx(scalars["charts/score"][0][1], abs=1e-6)


def bos_tokenizer():
    """One token per character; the tokenizer adds <s> in front of every text, as Llama 3's and Gemma's do."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz0123456789 +=?[]:\n"))}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    return tokenizer


def test_the_reward_model_sees_one_bos(tmp_path):
    """The chat template renders the BOS; tokenising that text with special tokens added put a second one in
    front, which changes the score (reward-model cards warn of it)."""
    tokenizer = bos_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    folder = str(tmp_path / "rm")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    scorer = learnt_reward.RewardModel(folder, CPU, torch.float32)
    (score,) = scorer.score(["what is 2+2?"], ["4"], [""])

    text = "<s>[user] what is 2+2?\n[assistant] 4\n"
    ids = [tokenizer.convert_tokens_to_ids("<s>")] + [tokenizer.convert_tokens_to_ids(c) for c in text[3:]]
    assert ids.count(tokenizer.bos_token_id) == 1
    with torch.no_grad():
        one_bos = model(torch.tensor([ids])).logits[0, 0].item()
        two_bos = model(torch.tensor([[tokenizer.bos_token_id] + ids])).logits[0, 0].item()
    assert abs(one_bos - two_bos) > 1e-3  # the test would notice a second BOS
    assert score == pytest.approx(one_bos, abs=1e-5)


def test_the_reward_sees_every_token_but_the_first_eos_and_after(tiny_tokenizer):
    """skip_special_tokens hid a <pad> or <unk> sampled mid-completion from the reward: the tiny policy learned to
    pad "123" with them to the full length and still scored 1. Now only the first EOS and what follows go."""
    t = tiny_tokenizer
    pad, eos, unk = t.pad_token_id, t.eos_token_id, t.unk_token_id
    d = {c: t.convert_tokens_to_ids(c) for c in "123"}
    completion_ids = torch.tensor(
        [
            [d["1"], d["2"], d["3"], eos, pad],  # the copy, then EOS: "123"
            [d["1"], pad, d["2"], d["3"], eos],  # a pad in the middle stays in the text
            [d["1"], d["2"], d["3"], unk, pad],  # no EOS: everything stays
            [eos, d["1"], d["2"], d["3"], eos],  # EOS first: the empty string
        ]
    )
    completion_mask = generation.mask_after_eos(completion_ids, [eos])
    texts = generation.decode_completions(t, completion_ids, completion_mask, [eos])
    assert texts == ["123", "1<pad>23", "123<unk><pad>", ""]
    assert [rewards.copy_reward("123=", text, "123") for text in texts] == [
        1.0,
        pytest.approx(1 / 8),
        pytest.approx(3 / 13),
        0.0,
    ]


def test_float16_is_refused_in_one_line():
    with pytest.raises(errors.UsageError, match="float16 would need loss scaling.*bfloat16"):
        precision.resolve_dtype("float16", CPU)


@pytest.mark.exact
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_weight_decay_is_a_flag_and_0_by_default(script, tmp_path, monkeypatch):
    """torch's AdamW decays by 0.01 unless told otherwise; the default here is 0, as in TRL and OpenRLHF."""
    module = {"grpo": grpo, "ppo": ppo}[script]
    assert module.Args().weight_decay == 0.0
    built = []
    real_adamw = torch.optim.AdamW

    def recording_adamw(*args, **kwargs):
        built.append(real_adamw(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(torch.optim, "AdamW", recording_adamw)
    extra = dict(group_size=2) if script == "grpo" else dict(update_epochs=1, num_minibatches=1)
    module.main(
        module.Args(
            num_steps=1, prompts_per_step=2, weight_decay=0.25, sample_every=0, output_dir=str(tmp_path), **extra
        )
    )
    (optimizer,) = built
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.25] * len(optimizer.param_groups)


def test_a_model_that_is_not_a_decoder_only_causal_lm_is_refused(tmp_path):
    """An encoder-decoder loads through no causal-LM path that computes what generate() samples: one line, not a
    traceback."""
    from transformers import T5Config, T5ForConditionalGeneration

    T5ForConditionalGeneration(T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, vocab_size=50)).save_pretrained(
        str(tmp_path / "t5")
    )
    with pytest.raises(errors.UsageError, match="is a t5 model, not a decoder-only causal LM"):
        models.load_causal_lm(str(tmp_path / "t5"), CPU)


@pytest.mark.exact
def test_no_decay_on_norms_and_biases_spares_exactly_those(tiny_model):
    """--no-decay-norms-and-biases: the HF Trainer's (TRL's) groups, decay on every matrix but no norm weight or
    bias."""
    decayed, spared = common.adamw_param_groups(tiny_model, 0.1, decay_norms_and_biases=False)
    names = {id(p): n for n, p in tiny_model.named_parameters()}
    spared_names = {names[id(p)] for p in spared["params"]}
    assert spared["weight_decay"] == 0.0 and decayed["weight_decay"] == 0.1 and spared_names
    assert all("norm" in n or n.endswith("bias") for n in spared_names)
    assert all("norm" not in names[id(p)] and not names[id(p)].endswith("bias") for p in decayed["params"])
    assert len(decayed["params"]) + len(spared["params"]) == len(list(tiny_model.parameters()))
    (every,) = common.adamw_param_groups(tiny_model, 0.1)
    assert len(every["params"]) == len(list(tiny_model.parameters())) and every["weight_decay"] == 0.1
