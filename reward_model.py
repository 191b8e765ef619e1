"""A reward model learnt from preference pairs (Bradley-Terry), in one file: the first stage of InstructGPT-style RLHF.

Ouyang et al. 2022 (InstructGPT), section 3.5 and eq. 1; Ziegler et al. 2019; Stiennon et al. 2020. A copy of the
LM with a scalar head reads prompt + completion and gives one number, r(x, y), at the last real token; it is trained
so that each pair's chosen completion scores above its rejected one: loss = -log sigmoid(r(x, y_c) - r(x, y_r)).
The saved `final` folder is a transformers sequence-classification model with one output, which ppo.py and grpo.py
take as they are with --reward-model, and score exactly as here (learnt_reward.reward_inputs: the same text, the same
tokens, the same last token).

    python reward_model.py                                     # tiny model, built-in preference task, CPU, ~3 min
    python ppo.py --reward-model runs/synthetic__reward_model__1__<time>/final    # then RLHF against it
    python reward_model.py --model HuggingFaceTB/SmolLM2-135M-Instruct --task jsonl:pairs.jsonl   # your pairs

Where this departs from the papers:
  1. Each pair is its own example (as in TRL and OpenRLHF): InstructGPT puts all K-choose-2 pairs of a prompt's K
     ranked completions in one batch, weighted 1 / C(K, 2), so that no completion is seen in two batches.
  2. The rewards are not shifted after training so that the reference's completions score 0 on average (InstructGPT,
     Stiennon et al.): PPO's critic absorbs a constant, and GRPO's group baseline removes it.
  3. The built-in task is synthetic (tasks/preferences.py): the labeller is a gold reward through Bradley-Terry
     noise, so the learnt reward can be checked against the truth, which human labels do not allow.
"""

import functools
import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

import common
from machinery import (
    batches,
    bookkeeping,
    checkpoints,
    dumps,
    flags,
    generation,
    learnt_reward,
    models,
    precision,
    startup,
    threads,
    tiny_model,
)
from tasks import preferences


@dataclass
class Args(flags.RunArgs):
    """A reward model from preference pairs (see the top of reward_model.py); the first flags (precision,
    checkpoints, logs) are shared with grpo.py and ppo.py. The defaults are the built-in tiny model's; on any other
    model, HUB_DEFAULTS replace some of them."""

    # Shared with the algorithm files: the same names, meanings and (but for the sizes) defaults.
    exp_name: str = "reward_model"
    """name of this experiment, part of the run folder's name"""
    seed: int = 1
    """seed of Python, numpy, torch, the synthetic pairs and the order of the pairs"""
    model: str = tiny_model.TINY_MODEL
    """hub id, local folder or .gguf file of the causal LM the reward model starts from (its scalar head is new)"""
    task: str = "synthetic"
    """the pairs: `synthetic` (sampled from --model, labelled by a gold reward) or jsonl:PATH (tasks/preferences.py)"""
    preset: Optional[Literal["tiny", "hub"]] = None
    """`hub` applies HUB_DEFAULTS to the fields left at their default (by default: on any model but tiny)"""
    num_steps: int = 600
    """training steps; each is one optimizer step on batch_size pairs"""
    max_new_tokens: int = 5
    """synthetic: longest sampled completion, in tokens (as grpo.py and ppo.py sample)"""
    learning_rate: float = 2e-3
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled)"""
    decay_norms_and_biases: bool = True
    """weight decay on biases and norm weights too; --no-decay-norms-and-biases spares them, as the HF Trainer
    (TRL) does"""
    warmup_steps: int = 0
    """steps of linear learning-rate warmup from 0"""
    max_grad_norm: float = 1.0
    """gradients are clipped to this global norm"""
    micro_batch_size: int = 64
    """pairs per forward/backward pass; the gradient is that of the whole batch"""
    eval_every: int = 50
    """held-out accuracy, margin and loss every this many steps, logged as eval/ (0: only after the last step)"""
    # The reward model's own: the pairs and the batch.
    num_pairs: int = 6144
    """synthetic: training pairs to sample (and a tenth as many held out, on the copy task's held-out prompts)"""
    label_beta: float = 30.0
    """synthetic: the labeller prefers a to b with probability sigmoid(label_beta * (gold(a) - gold(b)))"""
    batch_size: int = 64
    """pairs per optimizer step"""


# On a model other than tiny, these replace the defaults above; a flag given on the command line wins.
HUB_DEFAULTS = dict(
    num_pairs=2048, max_new_tokens=64, num_steps=200, batch_size=32, micro_batch_size=8, learning_rate=1e-5
)
SCRIPT = "reward_model"  # names its checkpoints and logs


def check_args(args):
    flags.check_run_args(args)
    flags.check_positive(args, "num_pairs", "max_new_tokens", "num_steps", "batch_size", "micro_batch_size")
    flags.check_range(args, "> 0", "label_beta")
    synthetic, policy_only = args.task == "synthetic", "in grpo.py and ppo.py, which train a policy"
    for name in ("num_pairs", "label_beta", "max_new_tokens"):
        flags.check_acts(args, name, synthetic, "with --task synthetic", "pass --task synthetic", HUB_DEFAULTS)
    for name in ("reward_model", "system_prompt", "dump_dir", "sample_every", "lora_rank"):
        flags.check_acts(args, name, False, policy_only, "run that script")
    if synthetic:
        preferences.check_synthetic_sizes(args.num_pairs)


def bradley_terry_loss(chosen_rewards, rejected_rewards, total_pairs):
    """The reward model's loss on a micro-batch of pairs, as its share of the whole batch's (Ouyang et al. 2022, eq. 1;
    Ziegler et al. 2019; Stiennon et al. 2020), a loss to minimise:

      P(y_c preferred to y_r | x) = sigmoid(r(x, y_c) - r(x, y_r))      the Bradley-Terry model of the labeller
      loss = -1/total_pairs * sum over pairs of log sigmoid(r(x, y_c) - r(x, y_r))

    chosen_rewards, rejected_rewards: [n], the scores of each pair's chosen and rejected completion. Summed over the
    micro-batches of a batch of total_pairs pairs, this is the batch's mean (TRL's RewardTrainer, without a margin).
    """
    return -torch.nn.functional.logsigmoid(chosen_rewards - rejected_rewards).sum() / total_pairs


def compute_loss(outputs, batch, args):
    """The loss entry point the training loop calls: bradley_terry_loss on a micro-batch's scores (outputs: chosen
    and rejected, [n] each, with the gradient) as its share of the batch of batch["num_pairs"] pairs. A new loss
    term goes here: each term it returns is logged under its own name (losses/bt_loss: the Bradley-Terry term, summed
    over the micro-batches; common.logged_losses). Returns the loss and, detached, its terms."""
    chosen, rejected = outputs["chosen"], outputs["rejected"]
    bt_loss = bradley_terry_loss(chosen, rejected, batch["num_pairs"])
    loss = bt_loss
    terms = dict(margin=chosen - rejected, bt_loss=bt_loss, loss=loss)
    return loss, {key: value.detach() for key, value in terms.items()}


def pair_scores(model, enc, n):
    """(r(x, y_chosen), r(x, y_rejected)), [n] each: the scalar head's output at each text's last token that is not
    the pad id, which transformers' *ForSequenceClassification reads (its `score` applied to the last hidden state),
    on `enc`, the 2n texts pair_inputs makes: what ppo.py's and grpo.py's --reward-model (learnt_reward.RewardModel)
    score."""
    rewards = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[:, 0].float()  # [2n]
    return rewards[:n], rewards[n:]


def pair_rewards(model, tokenizer, pairs, device):
    """pair_scores of `pairs`, tokenised by pair_inputs."""
    return pair_scores(model, pair_inputs(tokenizer, pairs, device), len(pairs))


def pair_inputs(tokenizer, pairs, device):
    """The pairs' chosen then rejected texts, tokenised by learnt_reward.reward_inputs (the same text, the same tokens
    and the same last token as learnt_reward.RewardModel), right-padded: [2n, T]."""
    prompts = [pair["prompt"] for pair in pairs]
    completions = [pair["chosen"] for pair in pairs] + [pair["rejected"] for pair in pairs]
    return learnt_reward.reward_inputs(tokenizer, prompts + prompts, completions).to(device)


def load_reward_model(name, device):
    """A sequence-classification model with one output, from a causal LM (a new scalar head) or a saved reward model."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # from a causal LM, the load report lists the new head and the unused LM head
    model = models.load_pretrained(AutoModelForSequenceClassification, name, device, num_labels=1)
    logging.set_verbosity(verbosity)
    return model


LOADERS = {"reward_model": load_reward_model}  # what --resume builds the checkpoint's model into


@torch.no_grad()
def evaluate(model, tokenizer, pairs, micro_batch_size, device, dtype):
    """On the held-out pairs: eval/accuracy (the share whose chosen scores higher), eval/margin (the mean of
    r_c - r_r) and eval/bt_loss (bradley_terry_loss on every held-out pair)."""
    model.eval()
    chosen, rejected = [], []
    for i in range(0, len(pairs), micro_batch_size):
        with common.autocast(device, dtype):
            scores = pair_rewards(model, tokenizer, pairs[i : i + micro_batch_size], device)
        chosen.append(scores[0])
        rejected.append(scores[1])
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    margin = chosen - rejected
    return {
        "eval/accuracy": (margin > 0).float().mean().item(),
        "eval/margin": margin.mean().item(),
        "eval/bt_loss": bradley_terry_loss(chosen, rejected, len(margin)).item(),
    }


def sample_completions(model_name, device, dtype, max_new_tokens):
    """The synthetic task's sampler: `sample(prompts)`, one completion of each prompt from the policy `model_name`
    at temperature 1 (as ppo.py and grpo.py sample it, cut before the EOS)."""
    policy = models.load_causal_lm(model_name, device)
    tokenizer = models.load_tokenizer(model_name)
    eos_ids = models.eos_token_ids(policy, tokenizer)

    def sample(prompts):
        with common.autocast(device, dtype):
            _, _, ids, mask = generation.generate(policy, tokenizer, prompts, max_new_tokens, 1.0, eos_ids)
        return generation.decode_completions(tokenizer, ids, mask, eos_ids)

    return sample


def main(args, flags_given=()):
    # SETUP: every flag, model name, the pairs (read, and checked against the tokenizer and positions of --model)
    # and the memory bound checked before anything loads.
    load_task = functools.partial(preferences.load_task, args=args)  # args: as the hub defaults leave them
    run = startup.start(SCRIPT, args, HUB_DEFAULTS, flags_given, check_args, load_task)
    task, device, dtype, run_dir = run.task, run.device, run.dtype, run.run_dir
    if task.train is None:  # synthetic: sampled from the policy now (seeded), which is then freed
        sample = sample_completions(args.model, device, dtype, args.max_new_tokens)
        task.train, task.test = preferences.synthetic_task_pairs(sample, args.num_pairs, args.label_beta, args.seed)
        del sample
    tokenizer = preferences.reward_tokenizer(args)  # --no-chat-template: without its template, saved so
    model = load_reward_model(args.model, device)  # float32 master weights, autocast to dtype
    if args.gradient_checkpointing == "on":  # auto: off (the reward model's bound counts its activations)
        precision.set_activation_checkpointing(model, True)
    threads.keep_freed_memory(model, device)  # on a CPU, a model's largest tensors reuse the last step's pages
    model.config.pad_token_id = tokenizer.pad_token_id  # how it finds each row's last token, here and in RewardModel
    preferences.check_lengths(tokenizer, task.train + task.test, model.config.get_text_config(), args.model)
    trained = {"reward_model": model}
    lrs = {"reward_model": args.learning_rate}
    optimizer, scheduler = startup.make_optimizer(trained, lrs, args, common.adamw_param_groups)
    sampler = batches.PromptSampler(task.train, args.seed)  # endless shuffled passes over the pairs
    history = {"bt_loss": [], "eval": {}, "tokens": 0}
    first_step, history = startup.resume(args, run, trained, optimizer, scheduler, sampler, LOADERS, history)
    writer = bookkeeping.make_writer(run_dir, args, first_step, **trained)
    checkpoint_dir = os.path.join(run_dir, "checkpoint")
    stop = checkpoints.StopSignal(checkpoint_dir)
    timer = bookkeeping.Timer()

    pbar = bookkeeping.progress(SCRIPT, first_step, args.num_steps)
    for step in pbar:
        # BATCH: batch_size pairs from shuffled passes over the training pairs, each micro-batch's chosen and
        # rejected texts tokenised as the reward model reads them.
        with timer("batch"):
            pairs = sampler.sample(args.batch_size)
            micro_pairs = [pairs[i : i + args.micro_batch_size] for i in range(0, len(pairs), args.micro_batch_size)]
            micro_inputs = [pair_inputs(tokenizer, micro, device) for micro in micro_pairs]  # [2n, T] each
            batch = dict(num_pairs=len(pairs))

        # OPTIMIZE: one step on the batch, accumulated over micro-batches.
        with timer("train"):
            model.train()
            optimizer.zero_grad(set_to_none=True)
            updates = []  # each micro-batch's terms: checked and logged below
            for micro, enc in zip(micro_pairs, micro_inputs):
                with common.autocast(device, dtype):
                    chosen, rejected = pair_scores(model, enc, len(micro))
                # ALGO LOGIC: the Bradley-Terry loss, -log sigmoid(r_chosen - r_rejected), its share of the batch mean.
                loss, terms = compute_loss(dict(chosen=chosen, rejected=rejected), batch, args)
                loss.backward()
                updates.append(terms)
            grad_norms = common.clip_grad_norms(trained, args.max_grad_norm)
            b_margins, b_loss = [terms["margin"] for terms in updates], sum(terms["loss"].item() for terms in updates)
            dumps.check_finite(step, "loss", b_loss, run_dir, {"margins": b_margins})
            optimizer.step()

        # LOGGING: the training batch's loss, accuracy and margin; the held-out pairs' every eval_every steps.
        margins = torch.cat(b_margins)  # [batch_size]
        history["bt_loss"].append(b_loss)
        history["tokens"] += sum(int(enc["attention_mask"].sum()) for enc in micro_inputs)
        scalars = {
            "charts/accuracy": (margins > 0).float().mean(),
            "charts/margin": margins.mean(),
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
        }
        if (args.eval_every and step % args.eval_every == 0) or step == args.num_steps:
            history["eval"] = evaluate(model, tokenizer, task.test, args.micro_batch_size, device, dtype)
            scalars.update(history["eval"])
        losses = dict(common.logged_losses([updates]), grad_norm=grad_norms["reward_model"])  # each term by its name
        bookkeeping.log_step(writer, step, scalars, losses, timer, history["tokens"], device)
        scheduler.step()  # after logging the rate this step's update used
        pbar.set_postfix(loss=f"{b_loss:.3f}", acc=f"{history['eval'].get('eval/accuracy', float('nan')):.3f}")
        if stop.requested() or (args.save_every and step % args.save_every == 0):
            checkpoints.save_checkpoint(
                checkpoint_dir, SCRIPT, args, trained, tokenizer, step, optimizer, scheduler, sampler, history=history
            )
        if stop.name:
            stop.exit(step, writer, SCRIPT)

    final_dir = os.path.join(run_dir, "final")
    checkpoints.save_model(model, tokenizer, final_dir, step=args.num_steps)  # AutoModelForSequenceClassification
    writer.close()
    checkpoints.release_locks()
    evaluation = history["eval"]
    print(
        f"reward_model done: {len(history['bt_loss'])} steps, {time.time() - run.start_time:.0f}s | held-out pairs "
        f"{len(task.test)}: accuracy {evaluation['eval/accuracy']:.3f}, margin {evaluation['eval/margin']:.3f} | "
        f"peak memory {bookkeeping.peak_memory_gb(device):.2f} GB | model saved to {final_dir}"
    )
    return evaluation


if __name__ == "__main__":
    bookkeeping.run_main(lambda: main(*flags.parse_args(Args, HUB_DEFAULTS)))
