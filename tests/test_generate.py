"""generation.generate with the built-in tiny model: the completion mask, pad == EOS, and whose settings sample."""

import copy

import pytest
import torch
from conftest import make_small_model

import common
from machinery import generation, models
from machinery.tiny_model import TINY_MODEL

PROMPTS = ["12=", "3=", "456=", "7="] * 8


def first_eos_mask(completion_ids, eos_ids):
    """1 up to and including each row's first EOS, written as a loop."""
    mask = torch.zeros_like(completion_ids)
    for b, row in enumerate(completion_ids.tolist()):
        for t, token in enumerate(row):
            mask[b, t] = 1
            if token in eos_ids:
                break
    return mask


@pytest.mark.exact
def test_completion_mask_is_zero_after_the_first_eos(tiny_model, tiny_tokenizer):
    eos_ids = models.eos_token_ids(tiny_model, tiny_tokenizer)
    torch.manual_seed(0)
    prompt_ids, prompt_mask, completion_ids, completion_mask = generation.generate(
        tiny_model, tiny_tokenizer, PROMPTS, 12, 1.0, eos_ids
    )
    assert prompt_ids.shape == prompt_mask.shape == (len(PROMPTS), 4)
    assert prompt_mask[1].tolist() == [0, 0, 1, 1]  # left padding
    assert torch.equal(completion_mask, first_eos_mask(completion_ids, eos_ids))
    lengths = completion_mask.sum(1)
    assert (lengths < completion_ids.shape[1]).any() and (lengths == 12).any()  # some rows stop early, some do not


@pytest.mark.exact
def test_generate_when_pad_is_eos(tiny_model, tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    eos_ids = models.eos_token_ids(tiny_model, tokenizer)
    assert tokenizer.pad_token_id in eos_ids
    torch.manual_seed(0)
    _, prompt_mask, completion_ids, completion_mask = generation.generate(
        tiny_model, tokenizer, PROMPTS, 12, 1.0, eos_ids
    )
    assert prompt_mask[1].tolist() == [0, 0, 1, 1]
    assert torch.equal(completion_mask, first_eos_mask(completion_ids, eos_ids))
    # Finished rows are filled with pad = EOS; only the first EOS of a row counts as a real token.
    stopped = [row for row, n in zip(completion_ids.tolist(), completion_mask.sum(1).tolist()) if n <= 10]
    assert stopped and all(row[row.index(tokenizer.eos_token_id) + 1] == tokenizer.eos_token_id for row in stopped)


def test_completions_start_after_the_prompt_when_every_row_stops_early(tiny_model, tiny_tokenizer):
    """Every token an EOS: each row stops after one token, so the generation is far shorter than max_new_tokens
    (6, not the prompt width 4 either) and the completion is the one column after the prompt: greedy, the argmax
    of the model's last prompt logits."""
    eos_ids = list(range(tiny_model.config.vocab_size))
    prompt_ids, prompt_mask, completion_ids, completion_mask = generation.generate(
        tiny_model, tiny_tokenizer, PROMPTS[:4], 6, 1.0, eos_ids, greedy=True
    )
    assert prompt_ids.shape == (4, 4) and completion_ids.shape == completion_mask.shape == (4, 1)
    positions = common.position_ids_from_mask(prompt_mask)
    with torch.no_grad():
        logits = tiny_model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions).logits
    assert completion_ids[:, 0].tolist() == logits[:, -1].argmax(-1).tolist()
    assert completion_mask.tolist() == [[1]] * 4


def total_variation(samples, probs):
    freqs = torch.bincount(samples, minlength=len(probs)).float() / len(samples)
    return 0.5 * (freqs - probs).abs().sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_samples_follow_softmax_of_logits_over_temperature(tiny_tokenizer, temperature):
    """The first completion token of 4000 copies of one prompt is distributed as softmax(logits / temperature)."""
    model = make_small_model()  # sharp logits: the two temperatures give distributions 0.2 apart
    torch.manual_seed(0)
    *_, completion_ids, _ = generation.generate(model, tiny_tokenizer, ["12="] * 4000, 1, temperature, [1])
    prompt_ids = tiny_tokenizer(["12="], return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(prompt_ids).logits[0, -1]
    other = 1.7 - temperature  # 0.7 <-> 1.0
    # Sampling noise alone gives a total variation of about 0.02 here.
    assert total_variation(completion_ids[:, 0], torch.softmax(logits / temperature, -1)) < 0.05
    assert total_variation(completion_ids[:, 0], torch.softmax(logits / other, -1)) > 0.1


def test_samples_are_not_cut_to_the_top_k(tiny_tokenizer):
    """transformers keeps only the top 50 tokens unless told otherwise; the log-probs assume all of them."""
    model = make_small_model(vocab_size=100, initializer_range=0.02)  # nearly uniform over 100 tokens
    torch.manual_seed(0)
    prompt_ids, prompt_mask, completion_ids, completion_mask = generation.generate(
        model, tiny_tokenizer, ["12=", "3="] * 8, 6, 1.0, [1]
    )
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], 1)
    with torch.no_grad():
        logits = model(
            input_ids, attention_mask=attention_mask, position_ids=common.position_ids_from_mask(attention_mask)
        ).logits
    logits = logits[:, prompt_ids.shape[1] - 1 : -1]  # [B, T, V], the distributions that sampled each token
    ranks = (logits > logits.gather(-1, completion_ids[..., None])).sum(-1)  # 0 for the most likely token
    assert (ranks[completion_mask.bool()] >= 50).any()


def test_sampling_ignores_the_models_suppress_tokens(tiny_tokenizer):
    model = models.load_causal_lm(TINY_MODEL, torch.device("cpu"))
    seven = tiny_tokenizer.convert_tokens_to_ids("7")
    model.generation_config.suppress_tokens = [i for i in range(len(tiny_tokenizer)) if i != seven]
    torch.manual_seed(0)
    *_, completion_ids, _ = generation.generate(
        model, tiny_tokenizer, PROMPTS, 5, 1.0, models.eos_token_ids(model, tiny_tokenizer)
    )
    assert (completion_ids != seven).any()  # 160 tokens all "7" from the model's own distribution: never


def test_sampling_ignores_the_models_no_repeat_ngram_size(tiny_tokenizer):
    model = models.load_causal_lm(TINY_MODEL, torch.device("cpu"))
    model.generation_config.no_repeat_ngram_size = 1  # would ban every token already in the row
    torch.manual_seed(0)
    prompt_ids, prompt_mask, completion_ids, completion_mask = generation.generate(
        model, tiny_tokenizer, PROMPTS, 8, 1.0, models.eos_token_ids(model, tiny_tokenizer)
    )
    rows = [
        p[pm.bool()].tolist() + c[cm.bool()].tolist()
        for p, pm, c, cm in zip(prompt_ids, prompt_mask, completion_ids, completion_mask)
    ]
    assert any(len(set(row)) < len(row) for row in rows)  # 32 rows of up to 12 tokens from a vocabulary of 25


def test_greedy_ignores_the_models_do_sample(tiny_tokenizer):
    model = models.load_causal_lm(TINY_MODEL, torch.device("cpu"))
    model.generation_config.do_sample = True  # as in Qwen2.5-Instruct's generation_config.json
    torch.manual_seed(0)
    *_, completion_ids, _ = generation.generate(
        model, tiny_tokenizer, ["12="] * 8, 6, 1.0, models.eos_token_ids(model, tiny_tokenizer), greedy=True
    )
    assert (completion_ids == completion_ids[0]).all()  # greedy: the same prompt gives the same completion
