"""RLHF's held-out watch: with --reward-model the policy is trained on a learnt reward (the proxy), and the task's own
reward, when it has one, is never trained on: it is kept as the *gold* reward, the true measure the proxy stands
for (Gao et al. 2022, "Scaling laws for reward model overoptimization"). Every --eval-every steps, on the held-out
prompts' completions (sampled as the rollout samples, from a fixed seed, without touching the run's random state):

    eval/reward_model_score   the reward model's mean score: what the policy is trained to raise
    eval/gold_reward          the task's reward of the same completions (your python:FILE.py:FUNCTION, a jsonl
                              task's match, a built-in task's): absent for a task of prompts alone
    eval/kl_ref               the mean over completions of sum over tokens of log pi - log pi_ref (k1 on the
                              sampled tokens: an unbiased estimate of KL(pi || pi_ref) of whole completions, nats;
                              losses/kl_ref is the per-token mean of the training batch)
    eval/completion_length    their mean length in tokens

Over-optimisation shows as eval/reward_model_score still rising while eval/gold_reward has peaked and falls. Without
--reward-model, `evaluate` is common.evaluate_policy (greedy accuracy and reward). A task of prompts alone
(jsonl:PATH of {"prompt": ...} lines, tasks/prompts.py) needs --reward-model (startup.check_task_reward).
"""

import torch

import common
from machinery import batches, generation, scoring
from machinery import distributed as dist

EVAL_PROMPTS = 200  # held-out prompts evaluated, the first of the split (as common.evaluate)
BATCH = 64  # completions sampled at once


def kl_per_completion(logp, ref_logp, mask):
    """Each completion's KL to the reference as Gao et al. plot it: sum over its real tokens of log pi - log pi_ref
    (k1 on the sampled tokens, whose mean over completions sampled from pi estimates KL(pi || pi_ref) without bias).
    logp, ref_logp, mask: [N, T]. Returns [N]."""
    return ((logp - ref_logp) * mask).sum(1)


@torch.no_grad()
def held_out_rlhf(policy, ref_model, scorer, tokenizer, task, args, eos_ids, device, dtype):
    """The eval/ scalars of a run with --reward-model (the module's docstring), on the first EVAL_PROMPTS held-out
    prompts, one completion each, sampled at --temperature from seed --seed (the same draws at every evaluation;
    the run's random state is put back after)."""
    examples = task.test[:EVAL_PROMPTS]
    proxy, gold, kl, lengths = [], [], [], []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(args.seed)
        for i in range(0, len(examples), BATCH):
            rows = examples[i : i + BATCH]
            prompts, answers = [ex["prompt"] for ex in rows], [ex["answer"] for ex in rows]
            with common.autocast(device, dtype), dist.full_weights(policy):
                prompt_ids, prompt_mask, ids, mask = generation.generate(
                    policy,
                    tokenizer,
                    prompts,
                    args.max_new_tokens,
                    args.temperature,
                    eos_ids,
                    chat_template=args.chat_template,
                )
            texts = generation.decode_completions(tokenizer, ids, mask, eos_ids)
            for scores, by in ((proxy, scorer), (gold, task if task.answers != "none" else None)):
                if by is not None:  # each completion's total: a dense reward summed, as the rollout's scores
                    scores.append(scoring.score_tokens(by, tokenizer, prompts, texts, answers, ids, mask).sum(1))
            lengths.append(mask.sum(1).float())
            if ref_model is not None:
                inputs = batches.model_inputs(
                    dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=ids, completion_mask=mask)
                )
                with common.autocast(device, dtype):
                    logp, ref_logp = (common.rollout_logprobs(m, inputs, args) for m in (policy, ref_model))
                kl.append(kl_per_completion(logp, ref_logp, mask.to(logp.dtype)))
    scalars = {"eval/reward_model_score": torch.cat(proxy).mean().item()}
    if gold:
        scalars["eval/gold_reward"] = torch.cat(gold).mean().item()
    if kl:
        scalars["eval/kl_ref"] = torch.cat(kl).float().mean().item()
    scalars["eval/completion_length"] = torch.cat(lengths).mean().item()
    return scalars


def evaluate(policy, ref_model, scorer, tokenizer, task, args, eos_ids, device, dtype):
    """The eval/ scalars a step logs every --eval-every steps: with --reward-model held_out_rlhf, else
    common.evaluate_policy (greedy, on the held-out split)."""
    if getattr(args, "reward_model", None):
        return held_out_rlhf(policy, ref_model, scorer, tokenizer, task, args, eos_ids, device, dtype)
    return common.evaluate_policy(policy, tokenizer, task, args, eos_ids, device, dtype)
