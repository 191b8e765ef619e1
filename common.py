"""Plumbing shared by grpo.py and ppo.py.

Nothing here defines an algorithm; it is what both need and nobody needs to read to understand them:
the reference formulas (KL estimators, masked statistics, the clipped surrogate, loss aggregation,
per-token log-probs), model and tokenizer loading (including the built-in tiny model), batched
generation, device and precision. Each formula is a small pure function with its source.
Run bookkeeping (shared flags, logging, checkpoints, dumps, faults) is in bookkeeping.py.
"""

import contextlib
import os
import shutil

import torch
from torch.utils.checkpoint import checkpoint


class UsageError(Exception):
    """Bad input from the user: reported as one line saying what to change, never as a traceback."""


# ---------------------------------------------------------------------------------------------------
# Reference formulas. Each is pure and tested against an independent computation in tests/.
# ---------------------------------------------------------------------------------------------------


def masked_mean(x, mask, dim=None):
    """Mean of `x` over the positions where `mask` is 1: sum(x * m) / sum(m), over `dim` or everything.

    Rows with no real position give 0, not NaN.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / sqrt(var + eps) with mean and (population) variance taken over real positions only.

    With shift_mean=False the mean is added back, so only the scale changes (used for rewards).
    Masked positions come back as 0, so padding can never leak into a later sum. Source: the
    `whiten` of Ziegler et al. 2019 (lm-human-preferences), restricted to a mask.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def kl_estimate(logp, ref_logp, kind):
    """Per-token estimate of KL(policy || ref) from the log-probs of tokens sampled from the policy.

    With log r = ref_logp - logp (Schulman 2020, "Approximating KL Divergence"):
      k1 = -log r                 unbiased, can be negative per token
      k2 = (log r)^2 / 2          biased, always >= 0
      k3 = (r - 1) - log r        unbiased, always >= 0 (the one GRPO puts in its loss)
    """
    log_r = ref_logp - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3', not {kind!r}")


def clipped_policy_loss(logratio, advantages, clip_low, clip_high):
    """Per-token PPO-clip surrogate loss (Schulman et al. 2017, eq. 7), written as a loss to minimise.

      ratio = exp(logratio),  logratio = logp - old_logp
      loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))

    clip_low != clip_high is DAPO's "clip-higher" (Yu et al. 2025).
    """
    ratio = torch.exp(logratio)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.max(pg_loss1, pg_loss2)


def clip_fraction(logratio, advantages, clip_low, clip_high, mask):
    """Share of real tokens whose gradient the clip cut off (the clipped term was the larger loss)."""
    ratio = torch.exp(logratio)
    clipped = ((ratio < 1 - clip_low) & (advantages < 0)) | ((ratio > 1 + clip_high) & (advantages > 0))
    return masked_mean(clipped.float(), mask)


def approx_kl(logratio, mask):
    """KL(old || new) over the tokens being trained, by the k3 estimator on logratio = logp - old_logp.

    Logged as losses/approx_kl, the usual "has the update moved the policy too far" signal.
    """
    return masked_mean(torch.exp(logratio) - 1 - logratio, mask)


LOSS_AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")


def aggregate_loss(loss, mask, agg, total_seqs, total_tokens, max_new_tokens):
    """Reduce a per-token loss [b, T] of one micro-batch to its share of the whole-batch loss.

    The denominators are those of the whole batch (`total_seqs` sequences, `total_tokens` real tokens),
    so summing the results over micro-batches gives exactly the one-batch loss, and its gradient.
      seq-mean-token-mean      mean over each sequence's tokens, then over sequences (GRPO paper)
      token-mean               every real token in the batch weighs the same (DAPO, Yu et al. 2025)
      seq-mean-token-sum-norm  sum over tokens / (sequences * max_new_tokens), a constant (Dr. GRPO,
                               Liu et al. 2025), so no length bias enters through the normaliser
    """
    mask = mask.to(loss.dtype)
    if agg == "seq-mean-token-mean":
        return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / total_seqs
    if agg == "token-mean":
        return (loss * mask).sum() / max(total_tokens, 1)
    if agg == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / (total_seqs * max_new_tokens)
    raise ValueError(f"agg must be one of {LOSS_AGGREGATIONS}, not {agg!r}")


def mask_after_eos(completion_ids, eos_ids):
    """[B, T] mask that is 1 up to and including each row's first EOS, 0 after it.

    Compares against the EOS ids, never the pad id: many tokenizers set pad = EOS.
    A row with no EOS keeps every token.
    """
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_ids, device=completion_ids.device))
    T = completion_ids.shape[1]
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], T, dtype=torch.long))
    return (torch.arange(T, device=completion_ids.device)[None, :] <= first_eos[:, None]).long()


def position_ids_from_mask(attention_mask):
    """Positions counted over real tokens only, so left padding does not shift them: [0 0 0 1 2 ...]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _logprobs_and_entropy(logits, labels, temperature):
    logits = logits.float() / temperature  # float32 for this chunk only
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels[..., None]).squeeze(-1) - logz
    with torch.no_grad():
        entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, entropy


def token_logprobs(model, input_ids, attention_mask, completion_mask, temperature, chunk_tokens=1024, return_entropy=False):
    """Per-token log-probs of the completion tokens under `model`, sampled at `temperature`.

    input_ids, attention_mask: [B, P + T], prompt (left-padded) then completion.
    completion_mask: [B, T], 1 on real completion tokens. Returns logp [B, T] (0 where masked),
    and the per-token entropy of the same distribution when return_entropy.

    log p(y_t) = z_t[y_t] / temp - logsumexp(z_t / temp), with z the logits of the model's own forward,
    so whatever its *ForCausalLM applies after the head (Gemma 2's softcap, Granite's and Cohere's logit
    scales) is in them, exactly as in the distribution generate() sampled from. The logits are divided by
    the sampling temperature, or the ratio would compare a different distribution. Only the completion's
    logits are computed (logits_to_keep), in the forward's precision; the float32 softmax runs on
    `chunk_tokens` positions at a time and is recomputed in the backward pass, so no float32
    [B, T, vocab] tensor exists, not even for autograd.
    """
    T = completion_mask.shape[1]
    position_ids = position_ids_from_mask(attention_mask)  # as generate() computes them under left padding
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=T + 1, use_cache=False)
    logits = out.logits[:, :-1]  # [B, T, vocab]: the logits at position t predict token t + 1
    labels = input_ids[:, -T:]
    rows = max(1, chunk_tokens // max(T, 1))
    logps, entropies = [], []
    for chunk, chunk_labels in zip(logits.split(rows), labels.split(rows)):
        if torch.is_grad_enabled():
            logp, entropy = checkpoint(_logprobs_and_entropy, chunk, chunk_labels, temperature, use_reentrant=False)
        else:
            logp, entropy = _logprobs_and_entropy(chunk, chunk_labels, temperature)
        logps.append(logp)
        entropies.append(entropy)
    mask = completion_mask.to(torch.float32)
    logp = torch.cat(logps) * mask
    return (logp, torch.cat(entropies) * mask) if return_entropy else logp


# ---------------------------------------------------------------------------------------------------
# Models, tokenizers and the built-in tiny model.
# ---------------------------------------------------------------------------------------------------

TINY_MODEL = "tiny"
TINY_CHARS = "0123456789+-*/=() ,.:?"  # enough for every built-in task
TINY_VERSION = 1  # bump when the recipe below changes, so old cached copies are rebuilt


def tiny_model_dir():
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(cache, "ppo-grpo-reference", f"tiny-qwen2-v{TINY_VERSION}")


def build_tiny_model(folder):
    """Write the built-in tiny model: a character-level tokenizer and a ~1M-parameter Qwen2, random init.

    It is saved like any hub model, so it then goes through the same AutoModel/AutoTokenizer path.
    The init is seeded, so every machine builds the same weights.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(TINY_CHARS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"], eos_token_id=vocab["<eos>"], bos_token_id=None,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    tmp = f"{folder}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    if os.path.isdir(folder):  # another process built it meanwhile
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, folder)


def resolve_model_path(name, flag="--model"):
    """`tiny` means the built-in tiny model (built into the cache on first use); anything else is as given."""
    if name == TINY_MODEL:
        folder = tiny_model_dir()
        if not os.path.isdir(folder):
            build_tiny_model(folder)
        return folder
    if not os.path.isdir(name) and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise UsageError(
            f"{flag} {name!r} is neither a local folder nor a hub id like Qwen/Qwen2.5-0.5B-Instruct: "
            f"fix the path{', or pass --model tiny' if flag == '--model' else ''}"
        )
    return name


def check_model_names(args, fields):
    """Refuse each model name of these Args that is neither a folder nor a hub id now, naming its flag."""
    for field in fields:
        if getattr(args, field) not in (None, TINY_MODEL):
            resolve_model_path(getattr(args, field), "--" + field.replace("_", "-"))


def _from_pretrained(loader, name, **kwargs):
    try:
        return loader.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"could not load {name!r} ({first_line}): check --model, the path or your network") from None


def quiet_transformers():
    from transformers.utils import logging

    logging.disable_progress_bar()  # "Loading weights" bars would bury the training progress bar


def saved_as_generic_tokenizer(path):
    """Whether a local folder's tokenizer_config.json names the generic class (as the tiny model's does)."""
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
    except (OSError, ValueError):
        return False


def load_tokenizer(name):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    quiet_transformers()
    path = resolve_model_path(name)
    # AutoTokenizer rebuilds the tokenizer of a qwen2 model as Qwen's byte-level BPE from the vocabulary alone,
    # ignoring tokenizer.json: the tiny model's would silently drop spaces and unknown characters.
    loader = PreTrainedTokenizerFast if saved_as_generic_tokenizer(path) else AutoTokenizer
    tokenizer = _from_pretrained(loader, path)
    tokenizer.padding_side = "left"  # generation appends to the right end of every prompt
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_pretrained(loader, name, device, dtype=torch.float32, **kwargs):
    """A model by hub id or local path through `loader` (an AutoModelFor... class), with every dropout set to 0.

    Dropout would make the ratio differ from 1 at the first update (policy and old policy would
    be two different random networks), so RL fine-tuning turns it off.
    """
    from transformers import AutoConfig

    quiet_transformers()
    path = resolve_model_path(name)
    config = _from_pretrained(AutoConfig, path, **kwargs)
    for key, value in vars(config).items():
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    model = _from_pretrained(loader, path, config=config, dtype=dtype)
    for module in model.modules():  # heads whose dropout no config key sets (classifier_dropout None means 0.1)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(device)


def load_causal_lm(name, device, dtype=torch.float32):
    """A decoder-only causal LM whose forward can return the completion's logits alone; anything else is refused."""
    import inspect

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = _from_pretrained(AutoConfig, resolve_model_path(name))
    if config.is_encoder_decoder or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{name!r} is a {config.model_type} model, not a decoder-only causal LM: pass one with --model")
    model = load_pretrained(AutoModelForCausalLM, name, device, dtype)
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise UsageError(f"{name!r} ({type(model).__name__}) cannot return the completion's logits alone (no logits_to_keep): use another architecture")
    return model


def check_vocabulary(tokenizer, task, model_name):
    """Refuse a task whose prompts the tokenizer cannot read (the tiny model knows only TINY_CHARS)."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return
    for example in task.train[:200]:
        if unk in tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]:
            raise UsageError(
                f"the prompts of task {task.name!r} have characters the tokenizer of {model_name!r} does not know "
                f"(e.g. in {example['prompt'][:60]!r}): use a hub model with --model, or a task the tiny model reads (copy, arithmetic)"
            )


def check_prompt_length(tokenizer, task, model, model_name, max_new_tokens, chat_template, batch_size=1000):
    """Refuse a task whose longest prompt, as generation encodes it, plus max_new_tokens overflows the model's positions."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not limit:
        return
    for examples in (task.train, task.test):
        for i in range(0, len(examples), batch_size):
            prompts = [example["prompt"] for example in examples[i : i + batch_size]]
            lengths = encode_prompts(tokenizer, prompts, chat_template)["attention_mask"].sum(1)
            longest = int(lengths.argmax())
            length = int(lengths[longest])
            if length + max_new_tokens > limit:
                fix = f"lower --max-new-tokens to {limit - length} or shorten the prompts" if length < limit else "shorten the prompts"
                raise UsageError(
                    f"a prompt of task {task.name!r} is {length} tokens ({prompts[longest][:40]!r}...); with --max-new-tokens "
                    f"{max_new_tokens} that is more than the {limit} positions of {model_name!r}: {fix}"
                )


def eos_token_ids(model, tokenizer):
    """Every id that ends a completion: the generation config's list (chat models have several) and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------
# Generation.
# ---------------------------------------------------------------------------------------------------


def encode_prompts(tokenizer, prompts, chat_template=True):
    """Tokenise prompts, left-padded; as a user turn of the tokenizer's chat template when it has one."""
    if chat_template and tokenizer.chat_template:
        messages = [[{"role": "user", "content": p}] for p in prompts]
        texts = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)  # the template has them
    return tokenizer(prompts, return_tensors="pt", padding=True)


def set_activation_checkpointing(model, on):
    """Recompute activations in the backward pass (non-reentrant), or stop; transformers 5 renamed the methods."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False}) if on else model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


@contextlib.contextmanager
def generation_mode(model):
    """Eval mode, and activation checkpointing off: it forces use_cache=False, making decoding quadratic."""
    was_training = model.training
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    was_checkpointing = getattr(model, flag, False)
    if was_checkpointing:
        set_activation_checkpointing(model, False)
    model.eval()
    try:
        yield
    finally:
        if was_checkpointing:
            set_activation_checkpointing(model, True)
        model.train(was_training)


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
        max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id, use_cache=True, **sampling
    )
    # generate() fills every field we leave unset from model.generation_config (a chat model's repetition
    # penalty, top-p, ...), which would sample from another distribution than the log-probs compute: hide it.
    model_config, model.generation_config = model.generation_config, GenerationConfig()
    try:
        with generation_mode(model):
            out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    finally:
        model.generation_config = model_config
    completion_ids = out[:, prompt_ids.shape[1] :]
    return prompt_ids, prompt_mask, completion_ids, mask_after_eos(completion_ids, eos_ids)


@torch.no_grad()
def evaluate(model, tokenizer, task, max_new_tokens, eos_ids, chat_template, num_examples=200, batch_size=64):
    """Greedy completions on the held-out split: eval/accuracy (share with reward 1) and eval/reward (mean)."""
    examples = task.test[:num_examples]
    rewards = []
    for i in range(0, len(examples), batch_size):
        batch = examples[i : i + batch_size]
        prompts, answers = [ex["prompt"] for ex in batch], [ex["answer"] for ex in batch]
        _, _, completion_ids, completion_mask = generate(
            model, tokenizer, prompts, max_new_tokens, 1.0, eos_ids, greedy=True, chat_template=chat_template
        )
        rewards += task.score(prompts, decode_completions(tokenizer, completion_ids, completion_mask, eos_ids), answers)
    return {"eval/accuracy": sum(r >= 1 for r in rewards) / len(rewards), "eval/reward": sum(rewards) / len(rewards)}


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


# ---------------------------------------------------------------------------------------------------
# Device and precision.
# ---------------------------------------------------------------------------------------------------


def pick_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name, device):
    """`auto` is bfloat16 on CUDA and float32 on CPU; float16 is refused (it needs loss scaling)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "float16":  # without a GradScaler, gradients below ~6e-8 underflow to 0 in float16
        raise UsageError("--dtype float16 would need loss scaling, which this project does not do: use --dtype bfloat16 or float32")
    return DTYPES[name]


def autocast(device, dtype):
    """Autocast to `dtype` for the forward passes. The trained weights stay float32 (the master copy):
    a bf16 weight cannot take an update of lr 1e-6 times a gradient, it rounds back to itself. The frozen
    reference is held the same way, so at step 1 it computes exactly what the policy does (KL 0)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
