"""Each algorithm's own flag checks, run by startup.start before anything loads: grpo.py's and ppo.py's (the flags
the scripts share are machinery/flags.py's check_run_args). Bad input is one line saying what to change."""

from machinery import distributed as dist
from machinery import flags
from machinery.errors import UsageError


def check_grpo_args(args):
    """grpo.py's flags: a group of at least 2, positive sizes and counts, beta >= 0, and each flag that acts only with
    another (--adv-eps with a std, --max-sampling-rounds with --dynamic-sampling) refused without it."""
    flags.check_run_args(args)
    if args.group_size < 2:
        raise UsageError(f"--group-size is {args.group_size}: GRPO needs at least 2 completions per prompt")
    flags.check_positive(args, "prompts_per_step", "max_new_tokens", "num_steps", "micro_batch_size")
    flags.check_positive(args, "num_iterations", "max_sampling_rounds")
    flags.check_range(args, ">= 0", "beta")
    flags.check_range(args, "> 0", "adv_eps")
    scaled, dynamic = args.scale_rewards != "none", args.dynamic_sampling
    flags.check_acts(args, "adv_eps", scaled, "when a std divides the advantages", "pass --scale-rewards group")
    flags.check_acts(args, "max_sampling_rounds", dynamic, "with --dynamic-sampling", "add --dynamic-sampling")
    dist.check_launch(args, args.group_size, "--group-size")  # under torchrun: whole groups on every process


def check_ppo_args(args, hub_defaults):
    """ppo.py's flags: positive sizes and counts, minibatches that divide the batch, the ranges of GAE and the
    coefficients, the critic's flags refused without a critic (--vf-coef 0), and --target-kl's controller bounded."""
    flags.check_run_args(args)
    flags.check_positive(args, "prompts_per_step", "max_new_tokens", "num_steps", "micro_batch_size")
    flags.check_positive(args, "samples_per_prompt", "update_epochs", "num_minibatches", "kl_horizon")
    dist.check_launch(args, args.samples_per_prompt)  # under torchrun: every process gets as many prompts
    batch_size = args.prompts_per_step * args.samples_per_prompt
    per_process = batch_size // dist.world_size()
    if per_process % args.num_minibatches:
        raise UsageError(
            f"--num-minibatches {args.num_minibatches} does not divide the batch of {per_process} completions"
            f"{' per process' if dist.world_size() > 1 else ''}: pick a divisor"
        )
    flags.check_range(args, "in [0, 1]", "gamma", "lam")
    flags.check_range(args, ">= 0", "kl_coef", "vf_coef", "ent_coef", "missing_eos_penalty")
    flags.check_range(args, "in (0, 1)", "critic_learning_rate")
    flags.check_range(args, "> 0", "cliprange_value", "adv_eps")
    flags.check_acts(args, "kl_horizon", args.target_kl is not None, "with --target-kl", "add --target-kl")
    for name in ("critic_model", "critic_learning_rate", "cliprange_value"):
        critic = "on the critic, and --vf-coef 0 loads none"
        flags.check_acts(args, name, args.vf_coef > 0, critic, "raise --vf-coef above 0", hub_defaults)
    if args.target_kl is not None and (args.target_kl <= 0 or args.kl_coef <= 0):
        raise UsageError("--target-kl needs a value > 0 and a starting --kl-coef > 0")
    if args.target_kl is not None and args.kl_horizon < batch_size:  # adaptive_kl_coef moves by up to 0.2 * N / horizon
        raise UsageError(
            f"--kl-horizon {args.kl_horizon} is below the {batch_size} completions of a step: the KL "
            f"coefficient could turn negative; use at least {batch_size}"
        )
