"""A reward model learnt from preference pairs (Bradley-Terry), in one file: the first stage of InstructGPT-style RLHF.

Ouyang et al. 2022 (InstructGPT), section 3.5 and eq. 1; Ziegler et al. 2019; Stiennon et al. 2020. A copy of the
LM with a scalar head reads prompt + completion and gives one number, r(x, y), at the last real token; it is trained
so that each pair's chosen completion scores above its rejected one: loss = -log sigmoid(r(x, y_c) - r(x, y_r)).
The saved `final` folder is a transformers sequence-classification model with one output, which ppo.py and grpo.py
take as they are with --reward-model, and score exactly as here (models.reward_inputs: the same text, the same
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

import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

import common
from machinery import bookkeeping, checkpoints, dumps, flags, lora, models, precision, threads
from machinery.errors import UsageError
from tasks.preferences import load_pairs


@dataclass
class Args:
    """A reward model from preference pairs (see the top of reward_model.py). The defaults are the built-in tiny
    model's; on any other model, HUB_DEFAULTS replace some of them."""

    exp_name: str = "reward_model"
    """name of this experiment, part of the run folder's name"""
    seed: int = 1
    """seed of Python, numpy, torch, the synthetic pairs and the order of the pairs"""
    model: str = models.TINY_MODEL
    """hub id, local folder or .gguf file of the causal LM the reward model starts from (its scalar head is new)"""
    task: str = "synthetic"
    """the pairs: `synthetic` (sampled from --model, labelled by a gold reward) or jsonl:PATH (tasks/preferences.py)"""
    preset: Optional[Literal["tiny", "hub"]] = None
    """`hub` applies HUB_DEFAULTS to the fields left at their default (by default: on any model but tiny)"""
    num_pairs: int = 6144
    """synthetic: training pairs to sample (and a tenth as many held out, on the copy task's held-out prompts)"""
    label_beta: float = 30.0
    """synthetic: the labeller prefers a to b with probability sigmoid(label_beta * (gold(a) - gold(b)))"""
    max_new_tokens: int = 5
    """synthetic: longest sampled completion, in tokens (as grpo.py and ppo.py sample)"""
    num_steps: int = 600
    """training steps; each is one optimizer step on batch_size pairs"""
    batch_size: int = 64
    """pairs per optimizer step"""
    micro_batch_size: int = 64
    """pairs per forward/backward pass; the gradient is that of the whole batch"""
    learning_rate: float = 2e-3
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled)"""
    warmup_steps: int = 0
    """steps of linear learning-rate warmup from 0"""
    max_grad_norm: float = 1.0
    """gradients are clipped to this global norm"""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """precision of the forward passes under autocast; weights stay float32 (see machinery/precision.py)"""
    threads: str = "auto"
    """threads of torch's CPU operations: auto (torch's default, at most the cores other processes leave idle; an
    OMP_NUM_THREADS of yours wins) or a number"""
    eval_every: int = 50
    """held-out accuracy, margin and loss every this many steps, logged as eval/ (0: only after the last step)"""
    save_every: int = 0
    """write a checkpoint every this many steps (0: only on a signal); the final model is always saved"""
    resume: Optional[str] = None
    """checkpoint folder to continue from, with the same Args"""
    output_dir: str = "runs"
    """TensorBoard logs, checkpoints and the final model go to output_dir/run_name"""


# On a model other than tiny, these replace the defaults above; a flag given on the command line wins.
HUB_DEFAULTS = dict(
    num_pairs=2048, max_new_tokens=64, num_steps=200, batch_size=32, micro_batch_size=8, learning_rate=1e-5
)
SCRIPT = "reward_model"  # names its checkpoints and logs


def check_args(args):
    for name, value in vars(args).items():
        flags.check_magnitude(name, value)
    flags.check_positive(args, "num_pairs", "max_new_tokens", "num_steps", "batch_size", "micro_batch_size")
    flags.check_range(args, "in (0, 1)", "learning_rate")
    flags.check_range(args, "> 0", "label_beta", "max_grad_norm")
    flags.check_range(args, ">= 0", "weight_decay", "warmup_steps", "eval_every", "save_every")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed is {args.seed}: it must be in [0, 2**32)")


def bradley_terry_loss(chosen_rewards, rejected_rewards, total_pairs):
    """The reward model's loss on a micro-batch of pairs, as its share of the whole batch's (Ouyang et al. 2022, eq. 1;
    Ziegler et al. 2019; Stiennon et al. 2020), a loss to minimise:

      P(y_c preferred to y_r | x) = sigmoid(r(x, y_c) - r(x, y_r))      the Bradley-Terry model of the labeller
      loss = -1/total_pairs * sum over pairs of log sigmoid(r(x, y_c) - r(x, y_r))

    chosen_rewards, rejected_rewards: [n], the scores of each pair's chosen and rejected completion. Summed over the
    micro-batches of a batch of total_pairs pairs, this is the batch's mean (TRL's RewardTrainer, without a margin).
    """
    return -torch.nn.functional.logsigmoid(chosen_rewards - rejected_rewards).sum() / total_pairs


def pair_rewards(model, tokenizer, pairs, device):
    """(r(x, y_chosen), r(x, y_rejected)), [n] each: the scalar head's output at each text's last token that is not
    the pad id, which transformers' *ForSequenceClassification reads (its `score` applied to the last hidden state),
    on the tokens models.reward_inputs makes: what ppo.py's and grpo.py's --reward-model (models.RewardModel) score."""
    prompts = [pair["prompt"] for pair in pairs]
    completions = [pair["chosen"] for pair in pairs] + [pair["rejected"] for pair in pairs]
    enc = models.reward_inputs(tokenizer, prompts + prompts, completions).to(device)
    rewards = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits[:, 0].float()  # [2n]
    return rewards[: len(pairs)], rewards[len(pairs) :]


def load_reward_model(name, device):
    """A sequence-classification model with one output, from a causal LM (a new scalar head) or a saved reward model."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # from a causal LM, the load report lists the new head and the unused LM head
    model = models.load_pretrained(AutoModelForSequenceClassification, name, device, num_labels=1)
    logging.set_verbosity(verbosity)
    return model


def check_lengths(tokenizer, pairs, limit, model_name):
    """Refuse a pair whose prompt and chosen or rejected completion, as the reward model reads them, overflow the
    model's positions."""
    halves = [(pair["prompt"], pair[key]) for pair in pairs for key in ("chosen", "rejected")]
    texts, templated = models.reward_texts(tokenizer, *zip(*halves))
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=not templated)["input_ids"]]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if limit and lengths[longest] > limit:
        pair, key = pairs[longest // 2], ("chosen", "rejected")[longest % 2]
        raise UsageError(
            f"{pair.get('where', 'a synthetic pair')}: its prompt and {key} completion are {lengths[longest]} tokens "
            f"as the reward model reads them, more than the {limit} positions of {model_name!r}: shorten or drop it"
        )


@torch.no_grad()
def evaluate(model, tokenizer, pairs, micro_batch_size, device, dtype):
    """On the held-out pairs: eval/accuracy (the share whose chosen scores higher), eval/margin (the mean of
    r_c - r_r) and eval/bt_loss."""
    model.eval()
    margins = []
    for i in range(0, len(pairs), micro_batch_size):
        with common.autocast(device, dtype):
            chosen, rejected = pair_rewards(model, tokenizer, pairs[i : i + micro_batch_size], device)
        margins.append(chosen - rejected)
    margin = torch.cat(margins)
    return {
        "eval/accuracy": (margin > 0).float().mean().item(),
        "eval/margin": margin.mean().item(),
        "eval/bt_loss": bradley_terry_loss(margin, torch.zeros_like(margin), len(margin)).item(),
    }


def sample_completions(model_name, device, dtype, max_new_tokens):
    """The synthetic task's sampler: `sample(prompts)`, one completion of each prompt from the policy `model_name`
    at temperature 1 (as ppo.py and grpo.py sample it, cut before the EOS)."""
    policy = models.load_causal_lm(model_name, device)
    tokenizer = models.load_tokenizer(model_name)
    eos_ids = models.eos_token_ids(policy, tokenizer)

    def sample(prompts):
        with common.autocast(device, dtype):
            _, _, ids, mask = common.generate(policy, tokenizer, prompts, max_new_tokens, 1.0, eos_ids)
        return common.decode_completions(tokenizer, ids, mask, eos_ids)

    return sample


def main(args, flags_given=()):
    preset = flags.apply_hub_defaults(args, HUB_DEFAULTS, flags_given)
    check_args(args)
    models.resolve_model_path(args.model)  # a bad name is refused before anything else
    device = precision.pick_device()
    threads.resolve_threads(args.threads)  # printed, with the reason
    dtype = precision.resolve_dtype(args.dtype, device, args.model)  # printed, with the reason
    bookkeeping.seed_everything(args.seed)  # the synthetic pairs are sampled first
    start_time = time.time()
    sample = sample_completions(args.model, device, dtype, args.max_new_tokens) if args.task == "synthetic" else None
    train_pairs, test_pairs = load_pairs(args.task, sample, args.num_pairs, args.label_beta, args.seed)
    del sample  # the policy that sampled them
    state = checkpoints.load_checkpoint(args.resume, SCRIPT, args) if args.resume else None
    run_dir = bookkeeping.make_run_dir(args)  # made now, so no other run can take it
    flags.print_settings(args, run_dir, preset, HUB_DEFAULTS)

    tokenizer = models.load_tokenizer(args.model)
    model = load_reward_model(args.model, device)  # float32 master weights, autocast to dtype
    threads.keep_freed_memory(model, device)  # on a CPU, a model's largest tensors reuse the last step's pages
    model.config.pad_token_id = tokenizer.pad_token_id  # how it finds each row's last token, here and in RewardModel
    check_lengths(
        tokenizer, train_pairs + test_pairs, getattr(model.config, "max_position_embeddings", None), args.model
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / (args.warmup_steps + 1))
    )
    sampler = common.PromptSampler(train_pairs, args.seed)  # endless shuffled passes over the pairs
    first_step, history = 1, {"bt_loss": [], "eval": {}}
    if args.resume:  # the checkpoint's weights, optimizer, schedule, order of the pairs, RNG states and history
        lora.restore_weights(model, os.path.join(args.resume, "reward_model"), load_reward_model)
        first_step, history = checkpoints.restore_state(state, optimizer, scheduler, sampler)
    writer = bookkeeping.make_writer(run_dir, args, first_step, reward_model=model)
    checkpoint_dir = os.path.join(run_dir, "checkpoint")
    stop = checkpoints.StopSignal(checkpoint_dir)
    timer = bookkeeping.Timer()

    pbar = bookkeeping.progress(SCRIPT, first_step, args.num_steps)
    for step in pbar:
        # OPTIMIZE: one step on batch_size pairs, accumulated over micro-batches.
        with timer("train"):
            model.train()
            batch = sampler.sample(args.batch_size)
            optimizer.zero_grad(set_to_none=True)
            b_margins, b_loss = [], 0.0
            for i in range(0, len(batch), args.micro_batch_size):
                with common.autocast(device, dtype):
                    chosen, rejected = pair_rewards(model, tokenizer, batch[i : i + args.micro_batch_size], device)
                # ALGO LOGIC: the Bradley-Terry loss, -log sigmoid(r_chosen - r_rejected), its share of the batch mean.
                loss = bradley_terry_loss(chosen, rejected, len(batch))
                loss.backward()
                b_margins.append((chosen - rejected).detach())
                b_loss += loss.item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            dumps.check_finite(step, "loss", b_loss, run_dir, {"margins": b_margins})
            optimizer.step()

        # LOGGING: the training batch's loss, accuracy and margin; the held-out pairs' every eval_every steps.
        margins = torch.cat(b_margins)  # [batch_size]
        history["bt_loss"].append(b_loss)
        scalars = {
            "losses/bt_loss": b_loss,
            "losses/grad_norm": grad_norm,
            "charts/accuracy": (margins > 0).float().mean(),
            "charts/margin": margins.mean(),
            "charts/learning_rate": optimizer.param_groups[0]["lr"],
            "perf/train_seconds": timer.seconds["train"],
            "perf/peak_memory_gb": bookkeeping.peak_memory_gb(device),
            "perf/threads": threads.follow_idle_cores(),  # auto: the cores other processes left idle
        }
        if (args.eval_every and step % args.eval_every == 0) or step == args.num_steps:
            history["eval"] = evaluate(model, tokenizer, test_pairs, args.micro_batch_size, device, dtype)
            scalars.update(history["eval"])
        for name, value in scalars.items():
            writer.add_scalar(name, float(value), step)
        scheduler.step()  # after logging the rate this step's update used
        pbar.set_postfix(loss=f"{b_loss:.3f}", acc=f"{history['eval'].get('eval/accuracy', float('nan')):.3f}")
        if stop.requested() or (args.save_every and step % args.save_every == 0):
            checkpoints.save_checkpoint(
                checkpoint_dir,
                SCRIPT,
                args,
                {"reward_model": model},
                tokenizer,
                step,
                optimizer,
                scheduler,
                sampler,
                history=history,
            )
        if stop.name:
            stop.exit(step, writer, SCRIPT)

    final_dir = os.path.join(run_dir, "final")
    checkpoints.save_model(model, tokenizer, final_dir, step=args.num_steps)  # AutoModelForSequenceClassification
    writer.close()
    checkpoints.release_locks()
    evaluation = history["eval"]
    print(
        f"reward_model done: {len(history['bt_loss'])} steps, {time.time() - start_time:.0f}s | held-out pairs "
        f"{len(test_pairs)}: accuracy {evaluation['eval/accuracy']:.3f}, margin {evaluation['eval/margin']:.3f} | "
        f"peak memory {bookkeeping.peak_memory_gb(device):.2f} GB | model saved to {final_dir}"
    )
    return evaluation


if __name__ == "__main__":
    bookkeeping.run_main(lambda: main(*flags.parse_args(Args, HUB_DEFAULTS)))
