"""The checks that a model can be trained correctly, and that a step fits this machine: each runs once, at load
(or before it), costs at most one tiny forward pass, and refuses a misfit in one line (models.py calls them).

Only a model that can be trained correctly is trained: its attention is causal (a later token never changes an
earlier position's output), its weights are finite, every id its tokenizer (or the EOS) can write has an
embedding, and the chat template renders the prompt. An impossible step is refused before anything is
allocated, with the numbers.
"""

import os

import torch

from machinery.errors import UsageError, one_line

CHECKED = set()  # the models (by name) whose weights passed check_causal_and_finite: a reference or resume skips it
PROBE = "Probe 7 + 5 = ?"  # a message the chat template must render


def check_causal_and_finite(model, name, what="--model"):
    """Refuse a model whose weights are not all finite, or whose output at a position depends on a later token
    (a BERT LM head, a bidirectional critic: trained as causal, it learns from the answer it is shown).

    The probe: two 4-token sequences differing in their last token, one forward pass; the first three positions'
    outputs (logits, or a backbone's hidden states) must agree.
    """
    if name in CHECKED:
        return
    for key, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise UsageError(
                f"{what} {name!r}: its weight {key} holds NaN or inf values: restore the model's "
                "weights, or pass another model"
            )
    embeddings = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]], device=device) % embeddings
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    out = (out.logits if hasattr(out, "logits") else out.last_hidden_state).float()
    if not torch.allclose(out[0, :3], out[1, :3], rtol=1e-4, atol=1e-4):
        raise UsageError(
            f"{what} {name!r} ({type(model).__name__}) is not causal: a later token changes the output "
            "at earlier positions, so it would learn from the completion it is shown: pass a "
            "decoder-only causal LM"
        )
    CHECKED.add(name)


def check_token_ids(model, tokenizer, eos_ids, name):
    """Every id the tokenizer can write, and every EOS id, must have an embedding: an id past the embedding
    indexes out of range (a device-side assert on GPU)."""
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise UsageError(
            f"the tokenizer of {name!r} has {len(tokenizer)} tokens, but its model embeds only "
            f"{embeddings}: pass the tokenizer saved with the model (or resize its embeddings)"
        )
    bad = [i for i in eos_ids if not 0 <= i < embeddings]
    if bad:
        raise UsageError(
            f"the EOS id {bad[0]} of {name!r} is outside its {embeddings} embeddings: fix eos_token_id "
            "in its generation_config.json or tokenizer_config.json"
        )


def check_chat_template(tokenizer, name, chat_template):
    """A chat template that raises, or renders a message without it (every prompt would become the same text),
    is refused: the run would train on other text than the task's."""
    if not (chat_template and tokenizer.chat_template):
        return
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROBE}], add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # a Jinja template can raise anything
        raise UsageError(
            f"the chat template of {name!r} raised {type(e).__name__} ({one_line(e, 120)}) on a plain "
            "user message: fix the template, or pass --no-chat-template"
        ) from None
    if not isinstance(text, str) or PROBE not in text:
        raise UsageError(
            f"the chat template of {name!r} drops the message: {PROBE!r} renders as "
            f"{one_line(repr(text), 80)}: fix the template, or pass --no-chat-template"
        )


def machine_memory(device):
    """Bytes of memory a step can use at most: the GPU's total on CUDA, the machine's RAM on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def step_bytes(args, config, world_size=1):
    """A lower bound on the bytes one step of these Args holds at once, and its parts, from the model's config.

    Weights: the policy in float32 with its gradient and AdamW's two moments (16 bytes a parameter), a reference
    (4), a critic (16). Generation: each process's N completions of at least max_new_tokens + 1 positions keep
    a key and a value per layer (KV cache), and their logits over the vocabulary at each sampled token. The
    update: a micro-batch's logits, their log-softmax and gradient (3 float32 copies). Prompts count as 1 token.
    """
    text = config.get_text_config()  # an architecture without one of these sizes counts it as 1: still a lower bound
    vocab, hidden, layers = (
        getattr(text, key, None) or 1 for key in ("vocab_size", "hidden_size", "num_hidden_layers")
    )
    heads = getattr(text, "num_attention_heads", None) or 1
    kv_dim = getattr(text, "num_key_value_heads", None) or heads
    kv_dim = kv_dim * (getattr(text, "head_dim", None) or max(hidden // heads, 1))
    inner = getattr(text, "intermediate_size", None) or 4 * hidden
    params = vocab * hidden + layers * (4 * hidden * hidden + 3 * hidden * inner)
    copies = (
        16 + 4 * (getattr(args, "beta", 0) > 0 or getattr(args, "kl_coef", 0) > 0) + 16 * hasattr(args, "critic_model")
    )
    rows = args.prompts_per_step * getattr(args, "group_size", getattr(args, "samples_per_prompt", 1)) // world_size
    length = args.max_new_tokens + 1
    width = 4 if args.dtype in ("auto", "float32") else 2  # auto is float32 on CPU: the upper of the two
    parts = {
        "weights and optimizer state": params * copies,
        "the generation's KV cache": rows * length * layers * 2 * kv_dim * width,
        "the generation's logits": rows * vocab * 4,
        "a micro-batch's logits": min(args.micro_batch_size, rows) * args.max_new_tokens * vocab * 4 * 3,
    }
    return sum(parts.values()), parts


def check_step_fits(args, config, device, world_size=1):
    """Refuse a step that cannot fit in this machine's memory even at the lower bound of step_bytes, with the
    numbers."""
    need, parts = step_bytes(args, config, world_size)
    have = machine_memory(device)
    if need > have:
        biggest = max(parts, key=parts.get)
        where = "GPU memory" if device.type == "cuda" else "memory (RAM)"
        group = "--group-size" if hasattr(args, "group_size") else "--samples-per-prompt"
        raise UsageError(
            f"a step needs at least {gib(need)} GiB ({biggest}: {gib(parts[biggest])} GiB), more than the "
            f"{gib(have)} GiB of {where}: lower --prompts-per-step, {group}, --max-new-tokens or "
            "--micro-batch-size"
        )


def gib(size):
    return f"{size / 2**30:,.0f}" if size >= 100 * 2**30 else f"{size / 2**30:.3g}"
