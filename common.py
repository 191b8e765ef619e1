"""What grpo.py and ppo.py both call in a step: the one file to read beside either of them.

Drawing prompts (PromptSampler), a step's sampled and scored completions (rollout; the batched generate() is in
machinery/generation.py), the per-token log-probs of those completions (token_logprobs), the mean over real tokens
(masked_mean), the batch each entry point receives (entry_batch), and the logged statistics of an update (approx_kl,
clip_fraction, explained_variance, logged_losses). Nothing here is specific to one algorithm: the advantage, the loss
and the update are in grpo.py and ppo.py. The batch's plumbing is in machinery/batches.py, loading models in
machinery/models.py, tasks in tasks/__init__.py, the flags in machinery/flags.py, the run's logs in
machinery/bookkeeping.py, its checkpoints in machinery/checkpoints.py and its dumps and guards in machinery/dumps.py.
"""

import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from machinery import batches, generation, output_head, precision, prompt_cache, scoring
from machinery import distributed as dist
from machinery.models import position_ids_from_mask  # positions over real tokens: left padding shifts none

# ---------------------------------------------------------------------------------------------------
# A step's completions: this process's prompts, sampled by machinery/generation.py, and scored.
# ---------------------------------------------------------------------------------------------------


def sample_round(sampler, policy, tokenizer, scorer, per_prompt, args, device, dtype, eos_ids):
    """One round of a step's sampling: this process's prompts (sample_prompts), then `per_prompt` completions of each
    (rollout). The loops bind everything but the round with functools.partial; GRPO's dynamic sampling calls it
    again."""
    examples = sample_prompts(sampler, args)
    return rollout(policy, tokenizer, scorer, examples, per_prompt, args, device, dtype, eos_ids)


def sample_prompts(sampler, args):
    """This process's share of a step's --prompts-per-step prompts (one process: all of them)."""
    return sampler.sample(args.prompts_per_step)[dist.rows(args.prompts_per_step // dist.world_size())]


def rollout(policy, tokenizer, scorer, examples, per_prompt, args, device, dtype, eos_ids):
    """One round of sampling: `per_prompt` completions of each example's prompt, laid out prompt by prompt, and the
    task's reward on their tokens (score_tokens: an outcome score at the last token, a dense reward where earned).

    Returns a batch dict (concat_batches joins two, select_rows picks rows): prompts, answers, completions [N] and
    prompt_ids, prompt_mask [N, P], completion_ids, completion_mask [N, T], token_scores [N, T], scores [N] (sums),
    and each other field of the examples (a JSONL line's `margin`: example_fields), one entry a completion.
    """
    prompts = [ex["prompt"] for ex in examples for _ in range(per_prompt)]
    answers = [ex["answer"] for ex in examples for _ in range(per_prompt)]
    with autocast(device, dtype), dist.full_weights(policy):  # under torchrun: whole for generate()
        prompt_ids, prompt_mask, completion_ids, completion_mask = generation.generate(
            policy, tokenizer, prompts, args.max_new_tokens, args.temperature, eos_ids, chat_template=args.chat_template
        )
    completions = generation.decode_completions(tokenizer, completion_ids, completion_mask, eos_ids)
    token_scores = scoring.score_tokens(
        scorer, tokenizer, prompts, completions, answers, completion_ids, completion_mask
    )
    return dict(
        prompts=prompts,
        answers=answers,
        completions=completions,
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        token_scores=token_scores,
        scores=token_scores.sum(1),  # the completion's score: a dense reward counts as its sum
        **batches.example_fields(examples, per_prompt),
    )


def print_samples(step, batch, per_prompt, every, count=3):
    """--sample-every: the first completion of a few prompts, with its reward (at step 1 and every `every` steps)."""
    if every and (step % every == 0 or step == 1):
        for i in range(0, min(len(batch["prompts"]), count * per_prompt), per_prompt):
            tqdm.write(
                f"step {step} | {batch['prompts'][i]!r} -> {batch['completions'][i]!r} "
                f"| score {batch['scores'][i].item():.2f}"
            )


# ---------------------------------------------------------------------------------------------------
# Per-token log-probs of the completions, and means over their real tokens.
# ---------------------------------------------------------------------------------------------------


def _logprobs_and_entropy(head, x, labels, temperature, with_entropy, entropy_grad):
    logits = x if head is None else head(x)  # x: logits, or with a head the hidden states it reads
    logits = logits.float()  # float32 for this chunk only
    if temperature != 1:  # x / 1 is x to the bit: at 1 no copy of the chunk
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels[..., None]).squeeze(-1) - logz
    if not with_entropy:  # a softmax over the vocabulary saved
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # H = logZ - sum_v p_v z_v
        entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, entropy


def token_logprobs(
    model,
    input_ids,
    attention_mask,
    completion_mask,
    temperature,
    chunk_tokens=output_head.CHUNK_TOKENS,
    return_entropy=False,
    entropy_grad=False,
):
    """Per-token log-probs of the completion tokens under `model`, sampled at `temperature`.

    input_ids, attention_mask: [B, P + T], prompt (left-padded) then completion.
    completion_mask: [B, T], 1 on real completion tokens. Returns logp [B, T] (0 where masked),
    and the per-token entropy of the same distribution when return_entropy: a constant for the logs, or with
    entropy_grad a tensor with its gradient (for an entropy bonus in the loss).

    log p(y_t) = z_t[y_t] / temp - logsumexp(z_t / temp), with z the logits of the model's own forward,
    so whatever its *ForCausalLM applies after the head (Gemma 2's softcap, Granite's and Cohere's logit
    scales) is in them, exactly as in the distribution generate() sampled from. The logits are divided by
    the sampling temperature, or the ratio would compare a different distribution. Only the completion's
    logits are computed (logits_to_keep), in the forward's precision; the float32 softmax runs on
    `chunk_tokens` positions at a time and is recomputed in the backward pass, so no float32
    [B, T, vocab] tensor exists, not even for autograd (the entropy's included). Past one chunk, the head itself
    runs a chunk at a time, inside that recomputation, where its output is the model's logits (output_head.py):
    then the [B, T, vocab] logits never exist, nor their gradient.
    """
    B, T = completion_mask.shape
    head = output_head.splittable(model, B * T, chunk_tokens)  # None: the logits whole, as the model gives them
    with output_head.capture(head) as captured:
        out = _completion_forward(model, input_ids, attention_mask, T)
    if head is not None and not output_head.gives_the_models_logits(head, captured.hidden, out.logits):
        head, out = None, _completion_forward(model, input_ids, attention_mask, T)
    labels = input_ids[:, -T:]
    if head is None:  # the logits at position t predict token t + 1; `rows` whole rows a chunk
        rows = max(1, chunk_tokens // max(T, 1))
        chunks = zip(out.logits[:, :-1].split(rows), labels.split(rows))  # [rows, T, vocab], [rows, T]
    else:  # the hidden states the head reads, chunk_tokens positions a chunk
        hidden = captured.hidden[:, :-1].reshape(B * T, -1)  # [B * T, hidden]
        chunks = zip(hidden.split(chunk_tokens), labels.reshape(-1).split(chunk_tokens))
    logps, entropies = [], []
    for chunk, chunk_labels in chunks:
        args = (head, chunk, chunk_labels, temperature, return_entropy, entropy_grad)
        if torch.is_grad_enabled():
            logp, entropy = checkpoint(_logprobs_and_entropy, *args, use_reentrant=False)
        else:
            logp, entropy = _logprobs_and_entropy(*args)
        logps.append(logp)
        entropies.append(entropy)
    mask = completion_mask.to(torch.float32)
    logp = torch.cat(logps).view(B, T) * mask
    return (logp, torch.cat(entropies).view(B, T) * mask) if return_entropy else logp


def _completion_forward(model, input_ids, attention_mask, T):
    """The model's forward over prompt + completion with the logits of the last T + 1 positions (logits_to_keep)."""
    position_ids = position_ids_from_mask(attention_mask)  # as generate() computes them under left padding
    with precision.log_prob_attention(model, input_ids.device):  # on a CPU under bf16: attention in float32, faster
        # A prompt shared by several rows (GRPO's groups) is computed once, as a KV cache (machinery/prompt_cache.py).
        cache = prompt_cache.shared_prompt_cache(model, input_ids, attention_mask, position_ids, input_ids.shape[1] - T)
        if cache is None:
            return model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=T + 1,
                use_cache=False,
            )
        return model(  # the rows' own tokens: the last prompt token and the completion
            input_ids=input_ids[:, -T - 1 :],
            attention_mask=attention_mask,
            position_ids=position_ids[:, -T - 1 :],
            use_cache=True,
            logits_to_keep=T + 1,
            **{prompt_cache.cache_argument(model): cache},
        )


def autocast(device, dtype):
    """Autocast to `dtype` for the forward passes. The trained weights stay float32 (the master copy):
    a bf16 weight cannot take an update of lr 1e-6 times a gradient, it rounds back to itself. The frozen
    reference is held the same way, so at step 1 it computes exactly what the policy does (KL 0)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def adamw_param_groups(model, weight_decay, decay_norms_and_biases=True):
    """AdamW parameter groups: weight decay on every weight, or, as the HF Trainer (TRL) does, not on biases
    and norm weights (its name patterns and LayerNorm modules)."""
    if decay_norms_and_biases:
        return [{"params": list(model.parameters()), "weight_decay": weight_decay}]
    from transformers.trainer_pt_utils import get_parameter_names

    spared = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    decayed = set(get_parameter_names(model, [torch.nn.LayerNorm], spared))
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decayed], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0},
    ]


def clip_grad_norms(models, max_norm):
    """Clip each model's gradient to `max_norm` by its own global norm (a critic's does not shrink the policy's).
    Returns each model's norm before clipping, by name."""
    return {name: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) for name, model in models.items()}


def masked_mean(x, mask, dim=None):
    """Mean of `x` over the positions where `mask` is 1: sum(x * m) / sum(m), over `dim` or everything.

    Rows with no real position give 0, not NaN.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8, mean=masked_mean):
    """(x - mean) / sqrt(var + eps) with mean and (population) variance taken over real positions only
    (`mean`: under torchrun distributed.masked_mean, over every process's).

    With shift_mean=False the mean is added back, so only the scale changes (--whiten-rewards). Masked
    positions come back as 0. Source: the `whiten` of Ziegler et al. 2019 (lm-human-preferences), masked.
    """
    x_mean = mean(x, mask)
    var = mean((x - x_mean) ** 2, mask)
    whitened = (x - x_mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + x_mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def select_rows(batch, rows):
    """The rows `rows` (a slice or an index tensor) of every per-completion tensor and list of a batch dict (those
    as long as its completion_mask); other entries (None, counts, per-step scalars) are kept as they are."""
    n = len(batch["completion_mask"])
    picked = range(n)[rows] if isinstance(rows, slice) else rows.tolist()
    return {
        k: v[rows]
        if torch.is_tensor(v) and v.dim() > 0 and len(v) == n
        else [v[i] for i in picked]
        if isinstance(v, list) and len(v) == n
        else v
        for k, v in batch.items()
    }


# A step's entry points in the order the loops call them, each with the tensors (by the dump's names) that it, or the
# forward just before it, computes. The models' outputs reach compute_loss apart, as its `outputs` argument.
MODEL_OUTPUTS = ("new_logp", "new_values", "entropy")
ENTRY_POINTS = (
    ("compute_rewards", ("rewards",)),  # PPO's per-token reward; GRPO's rewards are the sampled scores
    ("compute_advantages", ("advantages", "returns")),
    ("compute_loss", (*MODEL_OUTPUTS, "per_token_loss", "loss")),
)


def entry_batch(entry, tensors):
    """The batch the entry point `entry` receives, from a step's tensors (the loop's, or a dump's: the same names):
    all of them but what it and every later entry point compute, so it never reads its own result. The loops and
    verify.py build each entry point's batch with this one function, so both give it the same keys."""
    names = [name for name, _ in ENTRY_POINTS]
    later = {key for _, keys in ENTRY_POINTS[names.index(entry) :] for key in keys}
    return {key: value for key, value in tensors.items() if key not in later}


def clipped_tokens(logratio, advantages, clip_low, clip_high):
    """The tokens whose gradient the PPO clip cuts off, [n, T] bool: the ratio beyond 1 - clip_low with A < 0, or
    beyond 1 + clip_high with A > 0 (there the clipped term is the larger loss, a constant). grpo_loss and ppo_loss
    return it among their terms as `clipped`; losses/clipfrac and verify's notes read it from there, so a loss that
    clips otherwise (CISPO's weight) returns its own."""
    ratio = torch.exp(logratio)
    return ((ratio < 1 - clip_low) & (advantages < 0)) | ((ratio > 1 + clip_high) & (advantages > 0))


def clip_fraction(logratio, advantages, clip_low, clip_high, mask):
    """Share of real tokens whose gradient the clip cut off (the clipped term was the larger loss)."""
    return masked_mean(clipped_tokens(logratio, advantages, clip_low, clip_high).float(), mask)


def approx_kl(logratio, mask):
    """KL(old || new) over the tokens being trained, by the k3 estimator on logratio = logp - old_logp.

    Logged as losses/approx_kl, the usual "has the update moved the policy too far" signal.
    """
    return masked_mean(torch.exp(logratio) - 1 - logratio, mask)


def explained_variance(values, returns, mask, mean=masked_mean):
    """1 - Var(returns - values) / Var(returns) over real tokens: 1 is a perfect critic, <= 0 a useless one.
    `mean` is masked_mean, or under torchrun distributed.masked_mean (over every process's tokens)."""
    residual = returns - values
    var_residual = mean((residual - mean(residual, mask)) ** 2, mask)
    var_returns = mean((returns - mean(returns, mask)) ** 2, mask)
    return 1 - var_residual / var_returns.clamp(min=1e-8)


# The loss's terms that are its inputs or outputs, not statistics (the dumps and verify read them), and those logged
# under another name; every other term a loss returns is logged under its own (logged_losses).
NOT_LOGGED = ("new_logp", "old_logp", "new_values", "old_values", "advantages", "returns", "mask", "per_token_loss")
NOT_LOGGED += ("loss", "logratio", "micro_index", "minibatch_index", "margin")
RENAMED = dict(pg_loss="policy_loss", v_loss="value_loss", clipped="clipfrac", value_clipped="clipfrac_value")


@torch.no_grad()
def logged_losses(updates):
    """The losses/ scalars of one step (docs/logs.md), from the terms each micro-batch's loss returned: every term but
    NOT_LOGGED, under its own name (RENAMED: pg_loss is policy_loss), and approx_kl from the logratio.

    updates: per optimizer step, the terms of each micro-batch (grpo_loss's or ppo_loss's, with the entropy). A term
    [n, T] is a token mean over its update's batch (a micro-batch weighs its share of the update's real tokens), one
    [n] a mean over its completions, one of no dimension (a count, a share of the loss) a sum over its micro-batches;
    under torchrun over every process's; each averaged over the step's updates.
    """
    names, sums = None, []  # per update: each statistic's sum and its weight, summed over micro-batches
    for micro_terms in updates:
        update = 0
        for terms in micro_terms:
            stats = loss_statistics(terms)
            names = list(stats)
            update = update + torch.stack(
                [torch.stack([value.double() * w if w > 0 else value.double(), w]) for value, w in stats.values()]
            )
        sums.append(update)
    sums = dist.sum(torch.stack(sums))  # [updates, statistics, 2]
    means = sums[..., 0] / sums[..., 1].clamp(min=1)
    return {name: value.item() for name, value in zip(names, means.mean(0))}


def loss_statistics(terms):
    """One micro-batch's statistics, (value, weight) by logged name, from the loss's own terms (a variant's loss says
    what it clipped): a mean over its real tokens weighs its tokens, over its rows their number, and a term of no
    dimension is summed (weight 0: divided by 1). reward_model.py's terms have no mask, and no per-token term."""
    mask = terms.get("mask")
    tokens = None if mask is None else mask.sum().double()
    stats = {"approx_kl": (approx_kl(terms["logratio"], mask), tokens)} if "logratio" in terms else {}
    for key, value in terms.items():
        if key in NOT_LOGGED or not torch.is_tensor(value):
            continue
        value = value.float() if value.dtype == torch.bool else value  # a mask of tokens: the share it holds
        one = torch.ones((), dtype=torch.float64, device=value.device)
        if mask is not None and value.shape == mask.shape:
            stats[RENAMED.get(key, key)] = (masked_mean(value, mask), tokens)
        elif value.dim() == 1:
            stats[key] = (value.mean(), one * len(value))
        elif value.dim() == 0:
            stats[key] = (value, one * 0)
    return stats


def rollout_logprobs(model, inputs, args):
    """The per-token log-probs [N, T] of a sampled batch's completions under `model`, by micro-batches (the caller
    holds torch.no_grad and autocast): the old policy's or the reference's, computed once a step."""
    return batches.in_micro_batches(token_logprobs, model, inputs, args.micro_batch_size, args.temperature)


# ---------------------------------------------------------------------------------------------------
# Greedy evaluation on the held-out split (--eval-every).
# ---------------------------------------------------------------------------------------------------


def evaluate_policy(policy, tokenizer, task, args, eos_ids, device, dtype):
    """evaluate() of the policy as a run holds it: under its autocast, with its whole weights under torchrun."""
    with autocast(device, dtype), dist.full_weights(policy):
        return evaluate(policy, tokenizer, task, args.max_new_tokens, eos_ids, args.chat_template)


def evaluate(model, tokenizer, task, max_new_tokens, eos_ids, chat_template, num_examples=200, batch_size=64):
    """Greedy completions on the held-out split: eval/accuracy (share with reward 1) and eval/reward (mean)."""
    examples = task.test[:num_examples]
    rewards = []
    for i in range(0, len(examples), batch_size):
        batch = examples[i : i + batch_size]
        prompts, answers = [ex["prompt"] for ex in batch], [ex["answer"] for ex in batch]
        _, _, completion_ids, completion_mask = generation.generate(
            model, tokenizer, prompts, max_new_tokens, 1.0, eos_ids, greedy=True, chat_template=chat_template
        )
        completions = generation.decode_completions(tokenizer, completion_ids, completion_mask, eos_ids)
        placed = scoring.score_tokens(task, tokenizer, prompts, completions, answers, completion_ids, completion_mask)
        rewards += placed.sum(1).tolist()  # a dense reward counts as its total
    # 1e-6: a dense reward's float32 total of a right answer can fall just short of 1 (3 x 1/3)
    return {
        "eval/accuracy": sum(r >= 1 - 1e-6 for r in rewards) / len(rewards),
        "eval/reward": sum(rewards) / len(rewards),
    }
