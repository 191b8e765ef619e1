"""A run's start-up, read in one direction: everything a run can be refused for is checked in `start`, in one pass
and before any weight loads (the flags, the model names, the critic's vocabulary and the memory bound, the task,
the device and precision, the checkpoint to resume); then the run folder is made, the dumps started, the settings
printed and the seeds set. The loaders after it (`load_policy`, `load_scorer`, `make_optimizer`, `resume`) build
what both algorithms hold, in the order grpo.py and ppo.py call them.
"""

import os
import time
import types

import torch

from machinery import bookkeeping, checkpoints, dumps, flags, lora, model_checks, models, precision, run_folder, threads
from machinery import distributed as dist
from machinery.errors import UsageError
from machinery.learnt_reward import RewardModel

MODEL_FLAGS = ("model", "critic_model", "reward_model")  # the Args fields that name a model, where a script has them


def start(script, args, hub_defaults, flags_given, check_args, load_task):
    """Apply the hub defaults, check everything, then make the run folder. Returns the run: its task, device,
    dtype, checkpoint state (None unless --resume), folder and start time."""
    threads.check_environment()  # OMP_NUM_THREADS=100000 would start that many threads at the first parallel op
    dist.check_environment()  # WORLD_SIZE, RANK and the like, read by the checks below
    check_cache_home(os.environ.get("XDG_CACHE_HOME"))
    run_folder.GIVEN.clear()
    run_folder.GIVEN.update(flags_given)  # an --output-dir given as its default still makes a branch of --resume
    preset = flags.apply_hub_defaults(args, hub_defaults, flags_given)
    check_args(args)
    check_model_names(args)
    task = load_task(args.task)
    check_task_reward(args, task)
    device = dist.init(precision.pick_device())  # under torchrun: join the other processes, one device each
    threads.resolve_threads(args.threads)  # printed, with the reason
    dtype = precision.resolve_dtype(args.dtype, device, args.model)  # printed, with the reason
    known = task if task.train is not None else None  # reward_model.py's synthetic pairs: sampled after start
    state = checkpoints.load_checkpoint(args.resume, script, args, known) if args.resume else None
    run_dir = bookkeeping.make_run_dir(args)  # made now, so no other run can take it
    dumps.start_dumps(args, script, run_dir)
    flags.print_settings(args, run_dir, preset, hub_defaults)
    bookkeeping.seed_everything(args.seed + dist.rank(), args.deterministic)  # each process its own completions
    return types.SimpleNamespace(
        task=task, device=device, dtype=dtype, state=state, run_dir=run_dir, start_time=time.time()
    )


def check_cache_home(cache):
    """XDG_CACHE_HOME, where the tiny models are built and the hub's models downloaded: an absolute folder this
    process can write in, or can make. One line otherwise (a relative one would move with the working folder)."""
    if cache is None:
        return
    existing = cache
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isabs(cache) or not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        why = (
            "not an absolute path" if not os.path.isabs(cache) else f"{existing} is not a folder this user can write in"
        )
        raise UsageError(
            f"XDG_CACHE_HOME is {cache[:80]!r}, {why}: the models are kept there; set it to a writable absolute "
            "folder, or unset it"
        )


def check_model_names(args):
    """Refuse each model name of these Args that is neither a folder nor a hub id now, naming its flag; a
    --critic-model whose vocabulary is not the policy's; a --system-prompt nothing takes, or too long; LoRA flags
    that do not fit the models' layers; and a step that cannot fit in this machine's memory (each from the models'
    configs and tokenizer: no weight loads)."""
    from transformers import AutoConfig

    for field in MODEL_FLAGS:
        if getattr(args, field, None) is not None:  # tiny too: built before torchrun's processes join (dist.init)
            path = models.resolve_model_path(getattr(args, field), flags.flag(field))
            model_checks.check_run_folder(path, flags.flag(field))
    if getattr(args, "reward_model", None) is not None:  # a reward model, by its config: no weight loads
        config = models.from_pretrained(AutoConfig, models.resolve_model_path(args.reward_model))
        model_checks.check_reward_model_config(config, args.reward_model, "--reward-model")
        check_embeddings(args.reward_model, config)
    if getattr(args, "critic_model", None) not in (None, args.model):
        check_same_vocabulary(args.model, args.critic_model)
    config = models.from_pretrained(AutoConfig, models.resolve_model_path(args.model))
    if args.system_prompt is not None:  # its length against the positions, once, before any prompt is encoded
        positions = getattr(config.get_text_config(), "max_position_embeddings", None)
        tokenizer = models.load_tokenizer(args.model, args.system_prompt)
        model_checks.check_system_prompt(tokenizer, args.model, args.chat_template, positions, args.max_new_tokens)
    lora.check_layers(args, model_checks.skeleton(config), args.model)
    critic_config = None
    if getattr(args, "vf_coef", 0) > 0:  # PPO's critic: its own backbone, from --critic-model or the policy's
        critic_config = models.from_pretrained(AutoConfig, models.resolve_model_path(args.critic_model or args.model))
        backbone = model_checks.skeleton(critic_config, backbone=True)
        flag = "--critic-model" if args.critic_model else "--model"
        lora.check_layers(args, backbone, args.critic_model or args.model, flag, critic=True)
    if hasattr(args, "prompts_per_step"):  # a policy's step; reward_model.py bounds its own with its pairs
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the one precision.pick_device picks
        model_checks.check_step_fits(args, config, device, dist.world_size(), critic_config)


def check_embeddings(reward_model, config):
    """A --reward-model whose tokenizer writes ids past its embeddings fails at its first score, step 1: refused now."""
    ids, size = model_checks.token_ids(models.load_tokenizer(reward_model)), config.get_text_config().vocab_size
    if ids > size:
        raise UsageError(
            f"--reward-model {reward_model!r}: its tokenizer writes ids up to {ids - 1}, but its model embeds only "
            f"{size}: pass a reward model saved with its own tokenizer (reward_model.py's RUN/final)"
        )


def check_task_reward(args, task):
    """A task of prompts alone (Task.answers "none") needs --reward-model; with one, the task's own reward is the
    gold reward, never trained on, which machinery/gold.py logs on the held-out prompts: said at start."""
    reward_model = getattr(args, "reward_model", None)
    if getattr(task, "answers", None) == "none" and not reward_model:
        raise UsageError(
            f'task {task.name!r} holds prompts alone (no "answer"), which no reward scores: pass --reward-model '
            'RUN/final (a reward model from reward_model.py), or give each line an "answer"'
        )
    if reward_model and task.answers != "none" and dist.is_main():
        when = f"every {args.eval_every} steps" if args.eval_every else "never (pass --eval-every N to watch it)"
        print(
            f"--reward-model: the policy is trained on the reward model's score; task {task.name!r}'s own reward is "
            f"the gold, never trained on, logged as eval/gold_reward on the held-out prompts {when}"
        )


def check_same_vocabulary(model, critic):
    """A --critic-model whose vocabulary is not the policy's: its embeddings would read other tokens, or none."""
    from transformers import AutoConfig

    vocabulary = models.load_tokenizer(model).get_vocab()
    path = models.resolve_model_path(critic)
    has_tokenizer = not os.path.isdir(path) or any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    )
    if has_tokenizer and models.load_tokenizer(critic).get_vocab() != vocabulary:
        raise UsageError(
            f"--critic-model {critic!r} has another vocabulary than --model {model!r}: "
            "pick a critic of the same model family (same tokenizer)"
        )
    size = models.from_pretrained(AutoConfig, path).get_text_config().vocab_size
    if size < len(vocabulary):
        raise UsageError(
            f"--critic-model {critic!r} embeds {size} tokens, fewer than the {len(vocabulary)} of "
            f"--model {model!r}'s tokenizer: pick a critic of the same model family"
        )


def load_policy(args, device):
    """(tokenizer, policy): float32 master weights (autocast computes in --dtype); with --lora-rank a frozen base
    with trained low-rank adapters (lora.py); activations recomputed where `checkpointing` says so."""
    tokenizer = models.load_tokenizer(args.model, args.system_prompt)
    policy = lora.wrap(models.load_causal_lm(args.model, device), args)
    if checkpointing(args, policy.config):
        precision.set_activation_checkpointing(policy, True)
    else:  # a heap that only grows buys speed; where activations are recomputed to save memory it would cost more
        threads.keep_freed_memory(policy, device)  # on a CPU, a model's largest tensors reuse the last step's pages
    return tokenizer, policy


def checkpointing(args, config):
    """Whether the policy recomputes its activations (model_checks.choose_checkpointing: --gradient-checkpointing on,
    or auto where a micro-batch's activations outweigh the rest of the step), printed with the reason (by the main
    process). Args keep `auto`, so a resume compares what was given."""
    from transformers import AutoConfig

    critic = getattr(args, "critic_model", None) if getattr(args, "vf_coef", 0) > 0 else None
    critic_config = models.from_pretrained(AutoConfig, models.resolve_model_path(critic)) if critic else None
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    on, reason = model_checks.choose_checkpointing(args, config, world_size, critic_config)
    if dist.is_main():
        print(f"activation checkpointing: {'on' if on else 'off'} ({reason})")
    return on


def load_scorer(args, run, tokenizer, policy):
    """(scorer, eos_ids): the --reward-model, or else the task, that scores completions; the task's prompts checked
    against the tokenizer and the model's context first; the token ids that end a completion."""
    scorer = RewardModel(args.reward_model, run.device, run.dtype) if args.reward_model else run.task
    if args.reward_model:
        scorer.check_task(run.task, args.max_new_tokens)
    models.check_vocabulary(tokenizer, run.task, args.model)
    models.check_prompt_length(tokenizer, run.task, policy, args.model, args.max_new_tokens, args.chat_template)
    return scorer, models.eos_token_ids(policy, tokenizer)


def make_optimizer(trained, learning_rates, args, param_groups):
    """AdamW over the trained models (each at its own learning rate; `param_groups`: which weights decay), and
    the linear warmup of --warmup-steps."""
    groups = [
        dict(group, lr=learning_rates[name])
        for name, model in trained.items()
        for group in param_groups(model, args.weight_decay, args.decay_norms_and_biases)
    ]
    optimizer = torch.optim.AdamW(groups)
    warmup = lambda step: min(1.0, (step + 1) / (args.warmup_steps + 1))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)


def resume(args, run, trained, optimizer, scheduler, sampler, loaders, history=None):
    """(first step, history): 1 and an empty history (`history`, by default grpo.py's and ppo.py's), or with
    --resume the checkpoint's weights (each trained model from its own folder, built by `loaders[name]`),
    optimizer, schedule, prompt order, RNG states and history."""
    if not args.resume:
        return 1, history or {"score": [], "length": [], "tokens": 0}
    for name, model in trained.items():
        lora.restore_weights(model, os.path.join(args.resume, name), loaders[name])
    checkpoints.check_unchanged(run.state)  # the weights read are of the step whose state was read
    return checkpoints.restore_state(run.state, optimizer, scheduler, sampler)
