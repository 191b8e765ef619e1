"""A causal LM's output head applied a chunk of positions at a time (common.token_logprobs), so that the logits of
a long completion over the whole vocabulary, [rows, T, vocab], never exist at once, nor their gradient.

At 512 completion tokens, 8 rows and SmolLM2's 49,152 tokens those logits are 0.8 GB in float32, and the backward
pass held three more tensors of that size (the gradient of each chunk, their concatenation, and the slice's
gradient padded back to the head's output). Applied here a chunk at a time inside common.token_logprobs' checkpoint,
a chunk's logits exist only while its log-probs are computed, and again while its gradient is.

The head may apply it only where its output is the model's logits. So the model's forward runs as it always did
(the same layers, the same `logits_to_keep`), but the head is given one position of each row: a forward pre-hook
keeps the hidden states it was given, and the model's own logits at that position are compared with the head's
output on the same hidden states. Equal to the bit, the head is the whole of what the model does after it;
otherwise (Gemma 2's softcap, Cohere's and Granite's logit scales) the model is remembered and its logits are
computed whole, as before. Under FSDP (torchrun) the head's weights are gathered only inside the model's forward:
there the logits are computed whole too.
"""

import contextlib
import weakref

import torch

CHUNK_TOKENS = 1024  # positions a chunk: 201 MB of float32 logits over a vocabulary of 49,152
TRANSFORMED = weakref.WeakSet()  # heads whose model changes their output (a softcap, a scale): never applied apart


def splittable(model, positions, chunk_tokens):
    """The output head of `model` when its `positions` completion positions span more than one chunk of
    `chunk_tokens` and the head may be applied apart from the model's forward; else None (the logits whole)."""
    from machinery import prompt_cache

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if positions <= chunk_tokens or head is None or head in TRANSFORMED or prompt_cache.is_sharded(model):
        return None
    return head


class Capture:
    """A forward pre-hook of the head: keeps the hidden states it is given (`hidden`) and lets it compute the last
    position of each row alone (the model's own logits there, for gives_the_models_logits)."""

    hidden = None

    def __call__(self, module, args):
        self.hidden = args[0]
        return (args[0][:, -1:].contiguous(), *args[1:])


@contextlib.contextmanager
def capture(head):
    """Within: the head's forward keeps its input (Capture); a no-op where head is None."""
    captured = Capture()
    handle = head.register_forward_pre_hook(captured) if head is not None else None
    try:
        yield captured
    finally:
        if handle is not None:
            handle.remove()


def gives_the_models_logits(head, hidden, logits):
    """Whether the head on the last position of `hidden` [B, L, H] gives the model's `logits` [B, 1, V] there, to the
    bit; if not, the head is remembered (TRANSFORMED) and never applied apart again."""
    same = hidden is not None and torch.equal(head(hidden[:, -1:].contiguous()).detach(), logits.detach())
    if not same:
        TRANSFORMED.add(head)
    return same
