"""TRL's GRPOTrainer (trl 1.16) as a verify.py adapter: `python verify.py DUMP --against trl`.

TRL runs its own pipeline on the dump's batch: a GRPOTrainer gets the stored completions through its
`rollout_func` hook (in place of sampling) and the stored rewards through a reward function, then its
`_generate_and_score_completions` pads, masks, computes the reference log-probs and the group advantages,
and its `compute_loss` gives the loss whose gradient is compared. The per-token loss and KL are TRL's own
tensors, read as `_compute_loss` returns (TRL returns only the aggregate); the per-token loss from stored
log-probs replaces TRL's forward by the stored ones. `update` steps the optimizer TRL's Trainer builds,
from one step to the next. Needs trl (pip install -r requirements/extra.txt). Our flags map to TRL's:

  --loss-agg seq-mean-token-mean / token-mean / seq-mean-token-sum-norm -> loss_type grpo / dapo / dr_grpo
  --scale-rewards, --importance-level, --beta, --clip-low/high, --num-iterations, --temperature,
  --max-new-tokens, --learning-rate, --weight-decay, --max-grad-norm   -> the same GRPOConfig fields
"""

import contextlib
import sys
import tempfile

import torch

from common import select_rows

try:
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head
except ImportError as e:
    raise ImportError(f"{e.msg}: the trl adapter needs TRL (pip install -r requirements/extra.txt)") from None

OPTIONS = {"use_bias_correction_kl": True}  # TRL's default; --set use_bias_correction_kl=false is grpo.py's
LOSS_TYPES = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}
state = {}


def written_out(args, options):
    """TRL's pieces this adapter writes out itself (every PASS line names them): a bug there would not show."""
    return [
        "the HF Trainer's training_step (its scaling of each micro-batch's loss for gradient accumulation, "
        "loss_is_scaled_for_ga): the adapter calls GRPOTrainer.compute_loss and sets the accumulation count itself"
    ]


def differences(args, options):
    """The known differences between TRL and grpo.py that this dump's flags switch on."""
    out = []
    if options["use_bias_correction_kl"] != bool(args.get("bias_corrected_kl")) and args["beta"] > 0:
        ours, theirs = bool(args.get("bias_corrected_kl")), options["use_bias_correction_kl"]
        out.append(
            f"TRL use_bias_correction_kl={theirs}, grpo.py --bias-corrected-kl {ours}: one of them "
            "weights the k3 term by the ratio exp(logp - old_logp) (the same value at ratio 1, but its "
            "gradient gains beta * kl * grad logp): pass --bias-corrected-kl to grpo.py, or --set "
            "use_bias_correction_kl=false here"
        )
    if args["weight_decay"] > 0 and args.get("decay_norms_and_biases", True):
        out.append(
            "the HF Trainer leaves biases and norm weights out of weight decay, grpo.py decays every "
            "weight: the update differs by lr * weight_decay * w on those weights"
        )
    if args["warmup_steps"] > 0:
        out.append("warmup: grpo.py's step s has lr * (s + 1) / (warmup + 1), the HF Trainer's lr * s / warmup")
    if state.get("absolute_positions"):
        out.append(
            "TRL's forward passes no position ids (grpo_trainer.py, _get_per_token_logps_and_entropies), so a model "
            "with learned absolute positions (GPT-2, tiny-gpt2) reads a left-padded prompt shifted by its padding, "
            "where generate() corrected it: the log-probs differ (rotary models, Qwen or --model tiny, are blind "
            "to the shift)"
        )
    return out


def setup(args, options, model):
    """A GRPOTrainer around `model` (the initial weights), set as the run; TRL loads its own reference."""
    if args["script"] != "grpo":
        raise NotImplementedError("it covers GRPOTrainer (TRL 1.16 ships no PPO trainer): use --against verl")
    N = args["prompts_per_step"] * args["group_size"]
    micro = min(args["micro_batch_size"], N)
    if N % micro or micro % args["group_size"]:
        raise NotImplementedError(
            f"TRL splits its batch into equal micro-batches of whole groups: --micro-batch-size {micro} does not "
            f"divide the {N} completions into groups of {args['group_size']}"
        )
    with _quiet_warnings():  # transformers' deprecation notices about fields TRL still sets
        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="verify-trl-"),
            report_to=[],
            use_cpu=True,
            bf16=False,
            seed=args["seed"],
            per_device_train_batch_size=micro,  # the run's micro-batches, accumulated over the whole batch
            gradient_accumulation_steps=N // micro,
            num_generations=args["group_size"],
            max_completion_length=args["max_new_tokens"],
            temperature=args["temperature"],
            beta=args["beta"],
            epsilon=args["clip_low"],
            epsilon_high=args["clip_high"],
            num_iterations=args["num_iterations"],
            loss_type=LOSS_TYPES[args["loss_agg"]],
            scale_rewards=args["scale_rewards"],
            importance_sampling_level=args["importance_level"],
            use_bias_correction_kl=options["use_bias_correction_kl"],
            learning_rate=args["learning_rate"],
            weight_decay=args["weight_decay"],
            max_grad_norm=args["max_grad_norm"],
            lr_scheduler_type="constant",
            save_strategy="no",
            logging_strategy="no",
        )
    state["absolute_positions"] = any(
        isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in ("wpe", "embed_positions")
        for name, module in model.named_modules()
    )
    tokenizer = state["tokenizer"] = _tokenizer(model)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    with _quiet_warnings():
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[_stored_rewards],
            args=config,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": [""]}),
            rollout_func=_stored_rollout,
        )
    hf_logging.set_verbosity(verbosity)
    trainer.current_gradient_accumulation_steps = N // micro  # set by Trainer.train(), which is never called here
    trainer.model.train()
    state["trainer"] = trainer


def _tokenizer(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model.config._name_or_path)


@contextlib.contextmanager
def _quiet_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rollout_func is "experimental"
        yield


def _stored_rollout(prompts, trainer):
    """In place of sampling: the dump's prompt and completion ids, unpadded (TRL pads them itself)."""
    batch = state["batch"]
    prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    completion = zip(batch["completion_ids"], batch["completion_mask"])
    completion_ids = [ids[m.bool()].tolist() for ids, m in completion]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def _stored_rewards(prompts, completions, row, **kwargs):
    """The dump's rewards (0 for token_logprobs, whose batch has none: its log-probs do not read them)."""
    rewards = state["batch"].get("rewards")
    return [float(rewards[i]) if rewards is not None else 0.0 for i in row]


def _prepare(batch):
    """TRL's own inputs for this batch: padding, masks, reference log-probs, advantages."""
    state["batch"] = batch
    rows = [
        {"prompt": state["tokenizer"].decode(ids[m.bool()]), "row": i}
        for i, (ids, m) in enumerate(zip(batch["prompt_ids"], batch["prompt_mask"]))
    ]
    with _quiet_warnings():
        inputs = state["trainer"]._generate_and_score_completions(rows)
    for key in ("prompt_ids", "completion_mask"):  # TRL pads them itself: it must land on the dump's
        theirs, ours = inputs[key].cpu(), batch[key].cpu()
        if theirs.shape != ours.shape or not torch.equal(theirs, ours):
            raise ValueError(f"TRL's {key} {tuple(theirs.shape)} differ from the dump's {tuple(ours.shape)}")
    if batch.get("old_logp") is not None and state["trainer"].num_iterations > 1:
        inputs["old_per_token_logps"] = batch["old_logp"]  # the sampling policy's, as the run froze them
    return inputs


def group_advantages(batch, args):
    return _prepare(batch)["advantages"]


def _patched(model, args):
    if not getattr(model, "_verify_fused", False):  # what GRPOTrainer does to its own model
        add_fused_lm_head(model, temperature=args["temperature"], outputs=("log_probs", "entropy"))
        model._verify_fused = True
    return model


def token_logprobs(model, batch, args):
    inputs = _prepare(batch)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    T = inputs["completion_ids"].shape[1]
    logps, _, _ = state["trainer"]._get_per_token_logps_and_entropies(_patched(model, args), ids, mask, T)
    return logps * inputs["completion_mask"]


def _loss_from_stored(batch, args):
    """TRL's _compute_loss on the stored log-probs and advantages of one micro-batch (padded anew, as TRL pads
    it); its locals are read as it returns."""
    trainer, batch = state["trainer"], _trimmed(batch)
    inputs = dict(_prepare(batch), advantages=batch["advantages"], old_per_token_logps=batch["old_logp"])
    if "ref_logp" in batch:
        inputs["ref_per_token_logps"] = batch["ref_logp"]
    # One micro-batch of the whole batch, as training_step gets it: the loss divided by the accumulation count
    # (grpo, bnpo, dr_grpo), and dapo's token count rescaled so that its normaliser is the whole batch's tokens
    # (it multiplies num_items_in_batch by the count over steps_per_generation).
    gas = trainer.current_gradient_accumulation_steps = round(batch["num_seqs"] / len(batch["completion_mask"]))
    inputs["num_items_in_batch"] = torch.tensor(float(batch["num_tokens"]) * trainer.args.steps_per_generation / gas)
    new_logp = batch["new_logp"].clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (new_logp, torch.zeros_like(new_logp), None)
    captured = {}

    def profiler(frame, event, arg):
        if event == "return" and frame.f_code is type(trainer)._compute_loss.__code__:
            captured.update(frame.f_locals)

    sys.setprofile(profiler)
    try:
        loss = trainer._compute_loss(trainer.model, inputs)
    finally:
        sys.setprofile(None)
        del trainer._get_per_token_logps_and_entropies
    return loss, captured


def _widened(per_token, batch):
    """A micro-batch's per-token values [n, w] back on the dump's width T (zeros past the last real column)."""
    mask = batch["completion_mask"]
    out = torch.zeros(mask.shape, dtype=per_token.dtype)
    out[:, : per_token.shape[1]] = per_token.detach().cpu()
    return out * mask


def kl(batch, args):
    _, local = _loss_from_stored(batch, args)
    return _widened(local["per_token_kl"], batch)


def per_token_loss(batch, args):
    _, local = _loss_from_stored(batch, args)
    width = local["per_token_logps"].shape[1] if "per_token_logps" in local else _trimmed(batch)["new_logp"].shape[1]
    return _widened(local["per_token_loss"].expand(len(batch["completion_mask"]), width), batch)


def loss(batch, args):
    return _loss_from_stored(batch, args)[0]


def _trimmed(batch):
    """A micro-batch without the padding columns it kept from the whole batch (TRL pads each micro-batch anew)."""
    first = int(batch["prompt_mask"].any(0).int().argmax())
    width = int(batch["completion_mask"].any(0).nonzero().max()) + 1
    T = batch["completion_mask"].shape[1]
    out = {}
    for key, value in batch.items():
        if key.startswith("prompt_"):
            value = value[:, first:]
        elif torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == T:
            value = value[:, :width]
        out[key] = value
    return out


def train_loss(model, batch, args, critic=None):
    """GRPOTrainer.compute_loss on one micro-batch of the step, as its training_step gets it: the advantages and
    the token count (num_items_in_batch) of the whole batch it was split from, normalised by its accumulation."""
    inputs = _prepare(_trimmed(batch))
    inputs["advantages"] = batch["advantages"]  # the whole batch's, as TRL splits them (its std: the advantages row)
    inputs["num_items_in_batch"] = torch.tensor(float(batch["num_tokens"]))
    state["trainer"].current_gradient_accumulation_steps = round(batch["num_seqs"] / len(batch["completion_mask"]))
    return state["trainer"].compute_loss(_patched(model, args), inputs)


def update(model, batch, args, step_state):
    """One training step with the optimizer TRL's Trainer builds (its weight-decay groups), kept in step_state
    from one step to the next: num_iterations optimizer steps, each after clipping the gradient's norm."""
    trainer = state["trainer"]
    if "optimizer" not in step_state:
        trainer.model, trainer.optimizer = _patched(model, args), None
        step_state["optimizer"] = trainer.create_optimizer()
    optimizer, size = step_state["optimizer"], state["trainer"].args.per_device_train_batch_size
    model.train()
    for _ in range(args["num_iterations"]):
        optimizer.zero_grad(set_to_none=True)
        for i in range(0, len(batch["completion_mask"]), size):  # TRL's accumulation over its micro-batches
            train_loss(model, select_rows(batch, slice(i, i + size)), args).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args["max_grad_norm"])
        optimizer.step()
