"""Every EOS id ends a completion: decoding strips whichever one ends it, and the tokenizer's own EOS joins
the generation config's list when they differ (chat models: <|im_end|> beside <|endoftext|>)."""

import types

import torch

from machinery import generation, models


def test_decoding_strips_each_of_two_eos_ids(tiny_tokenizer):
    """The second EOS id is '=' here: a row ending with it decodes without it, as one ending with the first."""
    eq, eos = tiny_tokenizer.convert_tokens_to_ids("="), tiny_tokenizer.eos_token_id
    digits = tiny_tokenizer.convert_tokens_to_ids(list("123"))
    ids = torch.tensor([digits + [eq], digits + [eos], digits[:2] + [eq, 0], digits + [eos]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]])
    texts = generation.decode_completions(tiny_tokenizer, ids, mask, [eos, eq])
    assert texts == ["123", "123", "12", "123"]
    assert generation.decode_completions(tiny_tokenizer, ids[:1], mask[:1], [eos]) == ["123="]  # '=' alone is text


def test_the_tokenizers_eos_joins_the_generation_configs(monkeypatch):
    from machinery import model_checks

    monkeypatch.setattr(model_checks, "check_token_ids", lambda *args: None)  # no model behind these ids
    model = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=[7, 9]), name_or_path="m")
    assert models.eos_token_ids(model, types.SimpleNamespace(eos_token_id=5)) == [7, 9, 5]
    assert models.eos_token_ids(model, types.SimpleNamespace(eos_token_id=9)) == [7, 9]
    model.generation_config.eos_token_id = 7
    assert models.eos_token_ids(model, types.SimpleNamespace(eos_token_id=3)) == [7, 3]
    assert models.eos_token_ids(model, types.SimpleNamespace(eos_token_id=None)) == [7]
