"""The checks that a model can be trained correctly, and that a step fits this machine: each runs once, at load
(or before it), costs at most one tiny forward pass, and refuses a misfit in one line (models.py calls them).

Only a model that can be trained correctly is trained: its attention is causal (a later token never changes an
earlier position's output), its weights are finite, every id its tokenizer (or the EOS) can write has an
embedding, and the chat template renders the prompt. An impossible step is refused before anything is
allocated, with the numbers.
"""

import os

import torch

from machinery import output_head
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
    embeddings = embedding_rows(model)
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


def embedding_rows(model):
    """The number of token ids `model` embeds (its input embedding's rows, also under LoRA adapters on it)."""
    return model.get_input_embeddings().weight.shape[0]


def token_ids(tokenizer):
    """How many ids the tokenizer may write: its count of tokens, or its largest id + 1 where ids have gaps."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def check_token_ids(model, tokenizer, eos_ids, name):
    """Every id the tokenizer can write, and every EOS id, must have an embedding: an id past the embedding
    indexes out of range (a device-side assert on GPU)."""
    embeddings = embedding_rows(model)
    if token_ids(tokenizer) > embeddings:
        raise UsageError(
            f"the tokenizer of {name!r} has {token_ids(tokenizer)} tokens, but its model embeds only "
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


SYSTEM_PROBE = "Probe system 3 * 4"  # a system message the chat template must render, under --system-prompt


def check_system_prompt(tokenizer, name, chat_template, positions, max_new_tokens):
    """--system-prompt (load_tokenizer keeps it as tokenizer.system_prompt) goes into the chat template's system
    turn: refused where nothing takes it (--no-chat-template, a model without a chat template, a template that
    raises on a system turn or leaves it out), and when its turn alone, with max_new_tokens, overflows the model's
    `positions` (every prompt would): measured once, in characters first (each token is at most the vocabulary's
    longest), so a prompt of 100,000 characters is refused in well under a second, never tokenized per prompt."""
    system = getattr(tokenizer, "system_prompt", None)
    if system is None:
        return
    if not (chat_template and tokenizer.chat_template):
        why = "--no-chat-template uses none" if not chat_template else f"{name!r} has none"
        raise UsageError(
            f"--system-prompt goes into the chat template's system turn, and {why}: drop --system-prompt, or "
            "write it into the task's prompts"
        )
    render = lambda text: tokenizer.apply_chat_template(
        [{"role": "system", "content": text}, {"role": "user", "content": PROBE}],
        add_generation_prompt=True,
        tokenize=False,
    )
    try:
        probe = render(SYSTEM_PROBE)
    except Exception as e:  # a Jinja template can raise anything: Gemma's refuses a system turn
        raise UsageError(
            f"the chat template of {name!r} takes no system turn (it raised {type(e).__name__}: "
            f"{one_line(e, 80)}): drop --system-prompt, or write it into the task's prompts"
        ) from None
    if SYSTEM_PROBE not in probe:
        raise UsageError(
            f"the chat template of {name!r} leaves the system turn out ({SYSTEM_PROBE!r} renders as "
            f"{one_line(repr(probe), 80)}): drop --system-prompt, or write it into the task's prompts"
        )
    if not positions:
        return
    budget = positions - max_new_tokens
    if len(system) > positions * max(map(len, tokenizer.get_vocab())):  # more tokens than positions, uncounted
        tokens = f"{len(system):,} characters, more than the {positions:,} positions of {name!r} can hold"
    else:
        count = len(tokenizer(render(system).replace(PROBE, ""), add_special_tokens=False)["input_ids"])
        if count <= budget:
            return
        tokens = f"{count:,} tokens in the chat template, and with --max-new-tokens {max_new_tokens} more than the "
        tokens += f"{positions:,} positions of {name!r}"
    raise UsageError(f"--system-prompt is {tokens}: shorten it (every prompt starts with it)")


def machine_memory(device):
    """Bytes of memory a step can use at most: the GPU's total on CUDA, the machine's RAM on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def skeleton(config, backbone=False):
    """The model `config` describes, built on the meta device (its modules and shapes, no memory; well under a
    second for a 7B model): AutoModelForCausalLM, or with `backbone` AutoModel (a critic's). None for a config
    neither builds: models.load_causal_lm refuses it, with its own line."""
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return (AutoModel if backbone else AutoModelForCausalLM).from_config(config)
    except Exception:  # noqa: BLE001 (any architecture transformers cannot build from this config)
        return None


def targeted(name, targets):
    """Whether a module named `name` gets LoRA adapters under --lora-target-modules `targets`, by peft's rule for a
    list of names: the module's full name is one of them, or ends with "." and one of them."""
    return any(name == target or name.endswith("." + target) for target in targets)


def adapted_layers(model, targets):
    """{name: module} of the layers of `model` that --lora-target-modules `targets` gives adapters: all-linear is
    every linear layer but the output head (peft's rule); names match linear and embedding layers (peft adapts no
    other kind)."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if tuple(targets) == ("all-linear",):
        return {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head}
    kinds = (torch.nn.Linear, Conv1D, torch.nn.Embedding)
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds) and targeted(n, targets)}


def lora_parameters(model, args):
    """Parameters of the adapters --lora-rank R adds to `model`: A [R, in] and B [out, R] per adapted layer."""
    rank, layers = getattr(args, "lora_rank", 0), adapted_layers(model, getattr(args, "lora_target_modules", ()))
    return sum(rank * sum(m.weight.shape) for m in layers.values()) if rank else 0


def model_bytes(model, args, trained, fallback):
    """Bytes of one model's weights and optimizer state, float32: 16 a trained parameter (weight, gradient and
    AdamW's two moments), 4 a frozen one. With --lora-rank a trained model's base is frozen and its adapters
    train. `fallback`: the parameters counted for a config the meta device cannot build (the embedding alone)."""
    params = sum(p.numel() for p in model.parameters()) if model is not None else fallback
    if not trained:
        return 4 * params
    if getattr(args, "lora_rank", 0) and model is not None:
        return 4 * params + 16 * lora_parameters(model, args)
    return 16 * params


def step_bytes(args, config, world_size=1, critic_config=None):
    """A lower bound on the bytes one step of these Args holds at once, and its parts, from the models' configs.

    The models, each counted on its skeleton (its exact parameters, no memory), float32: the policy (16 bytes a
    parameter: weight, gradient, AdamW's two moments; with --lora-rank its base is frozen, 4, and its adapters 16);
    the reference (4 a parameter) only when the KL coefficient (--beta, --kl-coef, --target-kl) is above 0, and
    with LoRA none (it is the policy with its adapters off); PPO's critic only with --vf-coef above 0, from
    `critic_config` (--critic-model's) or else the policy's, its backbone and value head counted as the policy is.
    Under torchrun, FSDP shards every model: each process holds 1/world_size of them. Generation: each process's
    N completions of at least max_new_tokens + 1 positions keep a key and a value per layer (KV cache, in the
    forward's precision: 2 bytes unless --dtype float32) and their float32 logits over the vocabulary at each
    sampled token. The update: the input of each of a micro-batch's layers, kept for the backward pass even when
    the layers recompute the rest (activation checkpointing), and one chunk's float32 logits over the vocabulary
    (common.token_logprobs computes them output_head.CHUNK_TOKENS positions at a time). Prompts count as 1 token.
    """
    text = config.get_text_config()  # an architecture without one of these sizes counts it as 1: still a lower bound
    vocab, hidden, layers = (
        getattr(text, key, None) or 1 for key in ("vocab_size", "hidden_size", "num_hidden_layers")
    )
    heads = getattr(text, "num_attention_heads", None) or 1
    kv_dim = getattr(text, "num_key_value_heads", None) or heads
    kv_dim = kv_dim * (getattr(text, "head_dim", None) or max(hidden // heads, 1))
    lora = getattr(args, "lora_rank", 0)
    kl = getattr(args, "beta", 0) > 0 or getattr(args, "kl_coef", 0) > 0 or getattr(args, "target_kl", None)
    policy = skeleton(config)
    parts = {
        "the policy's weights and optimizer state": model_bytes(policy, args, True, vocab * hidden),
        "the reference's weights": model_bytes(policy, args, False, vocab * hidden) if kl and not lora else 0,
    }
    if getattr(args, "vf_coef", 0) > 0:
        critic_text = (critic_config or config).get_text_config()
        critic_hidden = getattr(critic_text, "hidden_size", None) or 1
        critic_fallback = (getattr(critic_text, "vocab_size", None) or 1) * critic_hidden
        critic = model_bytes(skeleton(critic_config or config, backbone=True), args, True, critic_fallback)
        parts["the critic's weights and optimizer state"] = critic + 16 * (critic_hidden + 1)  # + the value head
    parts = {key: size // world_size for key, size in parts.items()}
    rows = args.prompts_per_step * getattr(args, "group_size", getattr(args, "samples_per_prompt", 1)) // world_size
    width = 4 if args.dtype == "float32" else 2  # auto: bfloat16 where the device computes it, the lower of the two
    tokens = min(args.micro_batch_size, rows) * args.max_new_tokens  # a micro-batch's completion tokens
    parts.update(
        {
            "the generation's KV cache": rows * (args.max_new_tokens + 1) * layers * 2 * kv_dim * width,
            "the generation's logits": rows * vocab * 4,
            "a micro-batch's layer inputs": tokens * layers * hidden * width,
            "a chunk's logits": min(tokens, output_head.CHUNK_TOKENS) * vocab * 4,
        }
    )
    return sum(parts.values()), parts


def activation_bytes(args, config, world_size=1):
    """An estimate (not a bound) of what a micro-batch's layers keep for the backward pass without activation
    checkpointing: per token and layer, four hidden-wide tensors (the layer's input, the normed inputs of attention
    and MLP, attention's output) and four MLP-wide ones (gate, up, the activation, their product), 2 bytes each
    unless --dtype float32; prompts count as 1 token. SmolLM2-135M, 8 rows of 513 tokens in float32: 3.9 GiB
    estimated, about 6 GiB measured (the attention's own tensors are left out)."""
    text = config.get_text_config()
    hidden, layers = (getattr(text, key, None) or 1 for key in ("hidden_size", "num_hidden_layers"))
    mlp = getattr(text, "intermediate_size", None) or 4 * hidden  # GPT-2's n_inner: 4 x hidden when unset
    rows = args.prompts_per_step * getattr(args, "group_size", getattr(args, "samples_per_prompt", 1)) // world_size
    tokens = min(args.micro_batch_size, rows) * (args.max_new_tokens + 1)
    return tokens * layers * 4 * (hidden + mlp) * (4 if args.dtype == "float32" else 2)


CHECKPOINTING_FLOOR = 2**30  # activations below this are left alone: the memory saved would not matter


def choose_checkpointing(args, config, world_size=1, critic_config=None):
    """(on, reason) for --gradient-checkpointing: on and off as given; auto: on where a micro-batch's activations
    (activation_bytes) would outweigh all else a step holds (step_bytes), so that recomputing them in the backward
    pass more than halves the step's memory, and pass CHECKPOINTING_FLOOR; else off.

    So a short completion keeps its step as it was (SmolLM2 in float32, --beta 0: 16 tokens in micro-batches of 32,
    0.51 GiB of activations against 2.2), and long ones recompute (512 tokens in micro-batches of 8: 3.9 against
    2.6)."""
    if args.gradient_checkpointing != "auto":
        return args.gradient_checkpointing == "on", f"--gradient-checkpointing {args.gradient_checkpointing}"
    activations, rest = (
        activation_bytes(args, config, world_size),
        step_bytes(args, config, world_size, critic_config)[0],
    )
    on = activations > max(rest, CHECKPOINTING_FLOOR)
    return on, (
        f"auto: a micro-batch's activations, ~{gib(activations)} GiB, against the rest of the step, {gib(rest)} GiB; "
        "on past both that and 1 GiB"
    )


def check_step_fits(args, config, device, world_size=1, critic_config=None):
    """Refuse a step that cannot fit in this machine's memory even at the lower bound of step_bytes, with the
    numbers."""
    need, parts = step_bytes(args, config, world_size, critic_config)
    have = machine_memory(device)
    if need > have:
        biggest = max(parts, key=parts.get)
        where = "GPU memory" if device.type == "cuda" else "memory (RAM)"
        group = "--group-size" if hasattr(args, "group_size") else "--samples-per-prompt"
        lora = "" if getattr(args, "lora_rank", 0) else "train LoRA adapters (--lora-rank 16), "
        fixes = {
            "the policy's weights and optimizer state": f"{lora}pick a smaller --model, or shard it (torchrun)",
            "the reference's weights": f"{lora}set the KL coefficient to 0 (no reference), or pick a smaller --model",
            "the critic's weights and optimizer state": f"{lora}pick a smaller --critic-model, or set --vf-coef 0",
        }
        fix = fixes.get(biggest, f"lower --prompts-per-step, {group}, --max-new-tokens or --micro-batch-size")
        raise UsageError(
            f"a step needs at least {gib(need)} GiB ({biggest}: {gib(parts[biggest])} GiB), more than the "
            f"{gib(have)} GiB of {where}: {fix}"
        )


def gib(size):
    return f"{size / 2**30:,.0f}" if size >= 100 * 2**30 else f"{size / 2**30:.3g}"


def pair_step_bytes(args, config, shortest):
    """A lower bound on the bytes one step of reward_model.py holds at once, and its parts, for 2 texts a pair of at
    least `shortest` tokens each: the reward model's weights and optimizer state (16 bytes a parameter, on the causal
    LM's skeleton); the batch's tokens, tokenised before the update (ids and mask as int64 tensors and, meanwhile, as
    the tokenizer's Python lists: 32 bytes a token, 128 a text); a micro-batch's activations kept for the backward
    pass: per token and layer the inputs of its linear maps (3 x hidden + the MLP's width: the attention's and the
    MLP's inputs, the output projection's and the down projection's), or with --gradient-checkpointing the layer's
    input alone, in the forward's precision."""
    text = config.get_text_config()
    hidden, layers = (getattr(text, key, None) or 1 for key in ("hidden_size", "num_hidden_layers"))
    width = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    per_token = hidden if args.gradient_checkpointing == "on" else 3 * hidden + width  # auto: off in reward_model.py
    rows = 2 * min(args.micro_batch_size, args.batch_size)
    precision = 4 if args.dtype == "float32" else 2
    parts = {
        "the reward model's weights and optimizer state": model_bytes(skeleton(config), args, True, 0),
        "the batch's tokens": 2 * args.batch_size * (32 * shortest + 128),
        "a micro-batch's activations": rows * shortest * layers * per_token * precision,
    }
    return sum(parts.values()), parts


def check_pairs_fit(args, config, shortest):
    """Refuse a reward-model step that cannot fit in this machine's memory even at pair_step_bytes' lower bound."""
    need, parts = pair_step_bytes(args, config, shortest)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    have = machine_memory(device)
    if need > have:
        biggest = max(parts, key=parts.get)
        fix = {
            "the reward model's weights and optimizer state": "pick a smaller --model",
            "the batch's tokens": "lower --batch-size",
        }.get(biggest, "lower --micro-batch-size, or pass --gradient-checkpointing on")
        where = "GPU memory" if device.type == "cuda" else "memory (RAM)"
        raise UsageError(
            f"a step needs at least {gib(need)} GiB ({biggest}: {gib(parts[biggest])} GiB), more than the "
            f"{gib(have)} GiB of {where}: {fix}"
        )


def check_run_folder(path, flag):
    """A run's folder given where a model is wanted: one line naming the model inside it (RUN/final)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return
    for inside in ("final", "checkpoint"):
        if os.path.isfile(os.path.join(path, inside, "config.json")) or os.path.isdir(os.path.join(path, inside)):
            raise UsageError(
                f"{flag} {path!r} is a run folder, not a model: pass {os.path.join(path, 'final')!r}, the model it "
                "saved at its end"
            )


def check_reward_model_config(config, name, flag):
    """From the config alone, before any weight loads: --reward-model must be a reward model (a sequence classifier
    with one output); reward_model.py's --model a causal LM, or such a reward model to train further."""
    heads = config.architectures or []
    outputs = getattr(config, "num_labels", 1)
    classifier = any(head.endswith("ForSequenceClassification") for head in heads)
    if flag == "--reward-model" and heads and not classifier:  # no architectures saved: its weights tell, at load
        causal = any(head.endswith(("ForCausalLM", "LMHeadModel")) for head in heads)
        what = "a causal LM" if causal else f"saved as {', '.join(heads)}"
        raise UsageError(
            f"--reward-model {name!r} is {what}, not a reward model (a sequence classifier with one output): "
            "train one with reward_model.py and pass its RUN/final"
        )
    if classifier and outputs != 1:
        use = "train one with reward_model.py" if flag == "--reward-model" else "pass a causal LM to start from"
        raise UsageError(
            f"{flag} {name!r} is a classifier ({', '.join(heads)}) that has {outputs} outputs: a reward model has 1; "
            f"{use}"
        )


def check_trained_head(missing, name, flag):
    """Refuse a reward model some of whose weights were not in its files (`missing`, from transformers' loading
    info): transformers makes them up at random, and a random scalar head scores every completion at random."""
    if missing:
        raise UsageError(
            f"{flag} {name!r} has no trained {sorted(missing)[0]!r} in its weights ({len(missing)} missing): "
            "transformers would make a random one, which scores at random: pass a trained reward model "
            "(reward_model.py's RUN/final)"
        )
