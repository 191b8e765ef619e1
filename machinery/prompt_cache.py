"""Each prompt computed once for the completions that share it: the KV cache of a group's prompt, repeated.

GRPO samples G completions of each prompt, laid out group by group. A plain forward of the batch computes every
prompt token G times, in generation and in each forward of the step (reference, old policy, update). Here the
prompt's keys and values are computed once per run of identical consecutive rows and indexed out to every row of
the run; each row then computes only its own tokens, attending to them as a cache. On SmolLM2 with its chat
template (46 prompt tokens, 16 new) a forward of 4 prompts x 8 then computes 4 x 45 + 32 x 17 tokens, not 32 x 62.

It is the same function: each token attends to the same keys and values; only the order of the float additions
in the matmuls differs (~1e-7 relative in float32). The index is differentiable, so in the update each row's
gradient flows back into its prompt's one computation, summed over the group as the plain forward's would be.
Used only where it cannot change a result: a plain attention cache (not a state-space or linear-attention one),
no activation checkpointing (which runs a layer again in the backward pass and drops the cache), and no gradient
through a model sharded by FSDP (is_sharded).
"""

import inspect

import torch


def prompt_runs(prompt_ids, prompt_mask):
    """(first row of each run of identical consecutive prompts [g], the run of each row [B]), ids and mask equal."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # [B - 1]
    run = torch.cat([same.new_zeros(1, dtype=torch.long), (~same).long().cumsum(0)])  # [B]
    first = torch.cat([run.new_zeros(1), (~same).nonzero()[:, 0] + 1])  # [g]
    return first, run


def cache_argument(model):
    """The name transformers gives the KV cache argument (`cache` from 5.24; `past_key_values` before), asked of
    the transformers model itself (a peft wrapper's forward takes **kwargs and passes them on)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def is_sharded(model):
    """FSDP (torchrun, distributed.py) frees the gathered weights after each forward call; the backward of the
    prompt's forward, the first of two, would find them gone. Without gradients, two calls are fine."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shareable_cache(model):
    """An empty KV cache for `model` if the prompt may be shared through it, else None."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    new_name = hasattr(type(model), "is_activation_checkpointing")  # transformers 5.x renamed it
    flag = "is_activation_checkpointing" if new_name else "is_gradient_checkpointing"
    if getattr(model, flag, False) or (torch.is_grad_enabled() and is_sharded(model)):
        return None
    try:
        cache = DynamicCache(config=model.config)
    except (TypeError, ValueError, KeyError):  # a cache layout this version of transformers cannot build
        return None
    plain = all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)
    return cache if plain and not getattr(model.config, "is_encoder_decoder", False) else None


def shared_prompt_cache(model, input_ids, attention_mask, position_ids, prompt_length):
    """The KV cache of each row's first prompt_length - 1 tokens, computed once per run of identical prompts and
    indexed out to every row: [B] rows of prompt_length - 1 positions. None when nothing would be shared (all
    prompts distinct, a one-token prompt) or the model's cache cannot be (shareable_cache); then run the plain forward.

    The last prompt token is left to the caller's forward, with the completion: its logits predict the first
    completion token, and generate() needs at least one token that is not in the cache.
    """
    if prompt_length < 2:
        return None
    first, run = prompt_runs(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
    if len(first) == len(input_ids):
        return None
    cache = shareable_cache(model)
    if cache is None:
        return None
    n = prompt_length - 1
    model(
        input_ids=input_ids[first, :n],
        attention_mask=attention_mask[first, :n],
        position_ids=position_ids[first, :n],
        use_cache=True,
        logits_to_keep=1,
        **{cache_argument(model): cache},
    )
    cache.batch_select_indices(run)  # [g, heads, n, d] -> [B, heads, n, d], each row its run's prompt
    return cache
