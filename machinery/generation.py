"""Sampling completions from a model: prompts encoded left-padded (through the chat template), one batched generate()
with a KV cache (a group's shared prompt computed once), the completions cut at their first EOS and decoded as the
model wrote them. common.rollout calls it for a step's samples; common.evaluate for greedy evaluation."""

import torch

from machinery import models, precision, prompt_cache
from machinery.models import position_ids_from_mask  # positions over real tokens: left padding shifts none


def encode_prompts(tokenizer, prompts, chat_template=True):
    """Tokenise prompts, left-padded; as a user turn of the tokenizer's chat template when it has one (with the
    system prompt given to models.load_tokenizer). Each distinct prompt is tokenised once (a group repeats one)."""
    row_of = {}
    rows = torch.tensor([row_of.setdefault(prompt, len(row_of)) for prompt in prompts], dtype=torch.long)
    distinct = list(row_of)
    if chat_template and tokenizer.chat_template:
        texts = models.chat_texts(tokenizer, distinct)
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)  # the template has them
    else:
        enc = tokenizer(distinct, return_tensors="pt", padding=True)
    return {key: value[rows] for key, value in enc.items()}  # [B, P] each


@torch.no_grad()
def generate(model, tokenizer, prompts, max_new_tokens, temperature, eos_ids, greedy=False, chat_template=True):
    """Sample one completion per prompt string, in one batched call with left padding and a KV cache.

    Returns prompt_ids, prompt_mask [B, P] and completion_ids, completion_mask [B, T]; the mask is 0
    after each row's first EOS.
    """
    from transformers import GenerationConfig

    enc = encode_prompts(tokenizer, prompts, chat_template)
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    # transformers samples from the top 50 by default; the log-probs assume the full distribution.
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        **sampling,
    )
    # generate() fills every field we leave unset from model.generation_config (a chat model's repetition
    # penalty, top-p, ...), which would sample from another distribution than the log-probs compute: hide it.
    model_config, model.generation_config = model.generation_config, GenerationConfig()
    try:
        with precision.generation_mode(model), precision.decoding_attention(model, prompt_ids, max_new_tokens):
            # A prompt repeated for a group is computed once (machinery/prompt_cache.py); generate() continues from
            # its cache.
            cache = prompt_cache.shared_prompt_cache(
                model, prompt_ids, prompt_mask, position_ids_from_mask(prompt_mask), prompt_ids.shape[1]
            )
            shared = {prompt_cache.cache_argument(model): cache} if cache is not None else {}
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, **shared)
    finally:
        model.generation_config = model_config
    completion_ids = out[:, prompt_ids.shape[1] :]
    return prompt_ids, prompt_mask, completion_ids, mask_after_eos(completion_ids, eos_ids)


def decode_completions(tokenizer, completion_ids, completion_mask, eos_ids):
    """Completion texts as the model wrote them, cut before the first EOS.

    Nothing else is dropped: a pad, <unk> or any other special token sampled mid-completion is in the
    text (skip_special_tokens would hide it from the reward, and a policy learns to pad with it).
    """
    texts = []
    for ids, length in zip(completion_ids.tolist(), completion_mask.sum(1).tolist()):
        ids = ids[:length]
        if ids and ids[-1] in eos_ids:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids, skip_special_tokens=False))
    return texts


def mask_after_eos(completion_ids, eos_ids):
    """[B, T] mask that is 1 up to and including each row's first EOS, 0 after it.

    Compares against the EOS ids, never the pad id: many tokenizers set pad = EOS.
    A row with no EOS keeps every token.
    """
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_ids, device=completion_ids.device))
    T = completion_ids.shape[1]
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], T, dtype=torch.long))
    return (torch.arange(T, device=completion_ids.device)[None, :] <= first_eos[:, None]).long()
