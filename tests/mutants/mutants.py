"""Hand-written mutants for tests/mutants/run.py: realistic bugs in how the loops use the formulas.

Each: `name`, the `file` it changes, an exact `find` snippet (it must occur once) and its `replace`, the
`tests` selection (pytest arguments) that must catch it, and `what` the bug is. When the code moves on and a
snippet is no longer found, update the snippet to the new code rather than deleting the mutant.
"""

REF_GRPO = ["tests/test_reference_step.py", "-k", "grpo"]
REF_PPO = ["tests/test_reference_step.py", "-k", "ppo"]
CONTROLLER = ["tests/test_loop_wiring.py", "-k", "controller or kl_coef"]
EVAL = ["tests/test_sampler_and_eval.py", "-k", "evaluate or eval_every"]
SAMPLER = [
    f"tests/test_sampler_and_eval.py::test_sampler_{name}"
    for name in (
        "gives_each_example_once_per_pass",
        "order_depends_on_its_seed_only",
        "state_round_trip_continues_the_same_sequence",
    )
]
RESUME = ["tests/test_reproducibility.py", "-k", "resume_continues"]
RESUME_EXACT = ["tests/test_resume_exact.py"]
GRADIENTS_GRPO = ["tests/test_gradients.py", "-k", "grpo"]
GRADIENTS_PPO = ["tests/test_gradients.py", "-k", "ppo"]
VERIFY_TOLERANCES = ["tests/test_verify_tolerances.py"]
VERIFY_BRANCHES = ["tests/test_verify_branches.py"]
DYNAMIC = ["tests/test_dynamic_sampling.py"]
CAUSAL = ["tests/test_dense.py", "-k", "not_causal"]
GROUP_LOGS = ["tests/test_explained_variance.py"]

MUTANTS = [
    # ---------------------------------------------------------------------------------------- grpo.py
    dict(
        name="grpo-old-logp-attached",
        file="grpo.py",
        tests=REF_GRPO,
        what="with mu = 1 the old log-probs are not detached: the ratio is exp(0) and the surrogate has no gradient",
        find="old_logp = new_logp.detach() if old_logp is None else old_logp",
        replace="old_logp = new_logp if old_logp is None else old_logp",
    ),
    dict(
        name="grpo-gspo-mean-over-padding",
        file="grpo.py",
        tests=REF_GRPO,
        what="GSPO's sequence log-ratio averages over padding too",
        find="logratio = common.masked_mean(logratio, mask, dim=1)[:, None].expand_as(logratio)",
        replace="logratio = logratio.mean(dim=1, keepdim=True).expand_as(logratio)",
    ),
    dict(
        name="grpo-answers-interleaved",
        file="common.py",
        tests=REF_GRPO,
        what=(
            "answers laid out prompt after prompt instead of group by group: "
            "rows scored against another prompt's answer"
        ),
        find='answers = [ex["answer"] for ex in examples for _ in range(per_prompt)]',
        replace='answers = [ex["answer"] for _ in range(per_prompt) for ex in examples]',
    ),
    dict(
        name="grpo-group-size-wrong",
        file="grpo.py",
        tests=REF_GRPO,
        what="advantages standardised over groups of prompts_per_step rows instead of group_size",
        find='return group_advantages(batch["rewards"], args.group_size, args.scale_rewards, args.adv_eps)',
        replace='return group_advantages(batch["rewards"], args.prompts_per_step, args.scale_rewards, args.adv_eps)',
    ),
    dict(
        name="grpo-kl-on-old-logp",
        file="grpo.py",
        tests=REF_GRPO,
        what="the k3 term uses the old (detached) log-probs: the KL term has no gradient",
        find="log_r = ref_logp - new_logp",
        replace="log_r = ref_logp - old_logp",
    ),
    dict(
        name="grpo-ref-rows-of-first-micro-batch",
        file="grpo.py",
        tests=REF_GRPO,
        what="every micro-batch takes the first rows' reference log-probs (a wrong slice)",
        find=(
            'micro_batch = common.entry_batch("compute_loss", common.select_rows(mb_batch, micro))\n'
            "                    loss"
        ),
        replace=(
            'micro_batch = common.entry_batch("compute_loss", common.select_rows(mb_batch, micro))\n'
            '                    micro_batch["ref_logp"] = '
            "b_ref_logp[: len(micro)] if b_ref_logp is not None else None\n"
            "                    loss"
        ),
    ),
    dict(
        name="grpo-loss-per-micro-batch",
        file="grpo.py",
        tests=REF_GRPO,
        what="the loss is normalised by the micro-batch's rows and tokens, not the whole batch's",
        find='mask, batch["num_seqs"], batch["num_tokens"], args)',
        replace="mask, len(mask), int(mask.sum()), args)",
    ),
    dict(
        name="grpo-zero-grad-once-per-step",
        file="grpo.py",
        tests=REF_GRPO,
        what="gradients zeroed once per step: iteration 2 adds to iteration 1's gradient",
        find=(
            "            for mb_inds in minibatches:\n"
            "                mb_batch = dict(b_rollout, num_seqs=len(all_scores), num_tokens=num_tokens)  "
            "# under torchrun: all's\n"
            "                optimizer.zero_grad(set_to_none=True)\n"
        ),
        replace=(
            "            optimizer.zero_grad(set_to_none=True)\n"
            "            for mb_inds in minibatches:\n"
            "                mb_batch = dict(b_rollout, num_seqs=len(all_scores), num_tokens=num_tokens)  "
            "# under torchrun: all's\n"
        ),
    ),
    dict(
        name="grpo-scheduler-per-iteration",
        file="grpo.py",
        tests=REF_GRPO,
        what="the learning-rate schedule steps once per iteration instead of once per training step",
        find="                optimizer.step()\n        dumps.dump_step(",
        replace="                optimizer.step()\n                scheduler.step()\n        dumps.dump_step(",
    ),
    dict(
        name="grpo-reference-is-policy",
        file="grpo.py",
        tests=REF_GRPO,
        what="the reference log-probs come from the current policy: the KL term is always 0",
        find="b_ref_logp = common.rollout_logprobs(ref_model, inputs, args) if ref_model else None",
        replace="b_ref_logp = common.rollout_logprobs(policy, inputs, args) if ref_model else None",
    ),
    dict(
        name="grpo-stats-summed-over-iterations",
        file="common.py",
        tests=REF_GRPO,
        what="the logged losses/ add up the num_iterations passes instead of averaging them",
        find="return {name: value.item() for name, value in zip(names, means.mean(0))}",
        replace="return {name: value.item() for name, value in zip(names, means.sum(0))}",
    ),
    dict(
        name="grpo-length-counts-prompt",
        file="grpo.py",
        tests=REF_GRPO,
        what="charts/completion_length counts the prompt's tokens too (the attention mask, not the completion mask)",
        find="lengths = dist.gather(b_mask.sum(1).float())",
        replace="lengths = dist.gather(inputs[1].sum(1).float())",
    ),
    dict(
        name="grpo-tokens-completion-only",
        file="grpo.py",
        tests=REF_GRPO,
        what="perf/tokens_per_second counts completion tokens only",
        find='history["tokens"] += dist.sum(int(sampled["prompt_mask"].sum() + b_mask.sum()))',
        replace='history["tokens"] += dist.sum(int(b_mask.sum()))',
    ),
    # ---------------------------------------------------------------------------------------- ppo.py
    dict(
        name="ppo-ratio-to-reference",
        file="ppo.py",
        tests=REF_PPO,
        what="the ratio is taken against the reference's log-probs instead of the rollout policy's",
        find="mb_batch = dict(b_rollout, num_seqs=",
        replace='mb_batch = dict(b_rollout, old_logp=b_rollout["ref_logp"], num_seqs=',
    ),
    dict(
        name="ppo-value-loss-args-swapped",
        file="ppo.py",
        tests=REF_PPO,
        what="new and old values swapped in the clipped value loss",
        find="v_loss = clipped_value_loss(new_values, old_values, returns, args.cliprange_value)",
        replace="v_loss = clipped_value_loss(old_values, new_values, returns, args.cliprange_value)",
    ),
    dict(
        name="ppo-loss-per-micro-batch",
        file="ppo.py",
        tests=REF_PPO,
        what="the loss is a token mean over the micro-batch, not over the minibatch it belongs to",
        find="loss = per_token_loss.sum() / max(minibatch_tokens, 1)",
        replace="loss = per_token_loss.sum() / max(int(mask.sum()), 1)",
    ),
    dict(
        name="ppo-micro-batch-from-perm",
        file="ppo.py",
        tests=REF_PPO,
        what=(
            "micro-batches are sliced from the epoch's permutation, not from the minibatch: "
            "every minibatch trains the same rows"
        ),
        find="for micro in mb_inds.split(args.micro_batch_size):",
        replace="for micro in torch.arange(N, device=device)[: len(mb_inds)].split(args.micro_batch_size):",
    ),
    dict(
        name="ppo-whiten-over-padding",
        file="ppo.py",
        tests=REF_PPO,
        what="advantages whitened with the padding counted as zeros",
        find="return common.masked_whiten(advantages, mask, eps=args.adv_eps, mean=mean), returns",
        replace="return common.masked_whiten(advantages, torch.ones_like(mask), eps=args.adv_eps, mean=mean), returns",
    ),
    dict(
        name="ppo-gae-gamma-lam-swapped",
        file="ppo.py",
        tests=REF_PPO,
        what="gamma and lambda passed to GAE in the wrong order",
        find='compute_gae(batch["rewards"], batch["values"], mask, args.gamma, args.lam)',
        replace='compute_gae(batch["rewards"], batch["values"], mask, args.lam, args.gamma)',
    ),
    dict(
        name="ppo-eos-penalty-inverted",
        file="ppo.py",
        tests=REF_PPO,
        what="the missing-EOS penalty hits the completions that did stop",
        find="scoring.score_at_last_token(args.missing_eos_penalty * (~has_eos).float(), mask)",
        replace="scoring.score_at_last_token(args.missing_eos_penalty * has_eos.float(), mask)",
    ),
    dict(
        name="ppo-kl-direction-swapped",
        file="ppo.py",
        tests=REF_PPO,
        what="the penalty estimates KL(ref || policy) from policy samples (arguments swapped)",
        find='kl = kl_estimate(batch["old_logp"], batch["ref_logp"], args.kl_estimator) * mask',
        replace='kl = kl_estimate(batch["ref_logp"], batch["old_logp"], args.kl_estimator) * mask',
    ),
    dict(
        name="ppo-controller-fed-token-mean",
        file="ppo.py",
        tests=CONTROLLER,
        what="the KL controller is fed the per-token mean KL instead of the summed KL per completion",
        find="seq_kl.mean().item(), args.target_kl, len(seq_kl)",
        replace='(seq_kl.sum() / batch["completion_mask"].sum()).item(), args.target_kl, len(seq_kl)',
    ),
    dict(
        name="ppo-kl-coef-not-stored",
        file="ppo.py",
        tests=CONTROLLER,
        what="the controller's new coefficient is computed but never stored: kl_coef stays at --kl-coef",
        find="kl_coef = next_kl_coef(b_rollout, args",
        replace="new_kl_coef = next_kl_coef(b_rollout, args",
    ),
    dict(
        name="ppo-kl-coef-from-initial",
        file="ppo.py",
        tests=CONTROLLER,
        what="the controller restarts from --kl-coef every step instead of compounding",
        find='adaptive_kl_coef(float(batch["kl_coef"]), seq_kl.mean().item()',
        replace="adaptive_kl_coef(args.kl_coef, seq_kl.mean().item()",
    ),
    dict(
        name="ppo-controller-counts-prompts",
        file="ppo.py",
        tests=CONTROLLER,
        what="the controller counts prompts instead of completions (samples_per_prompt ignored)",
        find="args.target_kl, len(seq_kl), args.kl_horizon)",
        replace="args.target_kl, args.prompts_per_step, args.kl_horizon)",
    ),
    dict(
        name="ppo-learning-rates-swapped",
        file="ppo.py",
        tests=REF_PPO,
        what="the policy gets the critic's learning rate and the critic the policy's",
        find='lrs = {"policy": args.learning_rate, "critic": args.critic_learning_rate}',
        replace='lrs = {"policy": args.critic_learning_rate, "critic": args.learning_rate}',
    ),
    dict(
        name="ppo-critic-not-clipped",
        file="common.py",
        tests=["tests/test_ppo.py", "-k", "clipped_to_max_grad_norm"],
        what="the critic's gradient is never clipped",
        find="clip_grad_norm_(model.parameters(), max_norm) for name",
        replace="clip_grad_norm_(model.parameters(), max_norm if name == 'policy' else float('inf')) for name",
    ),
    dict(
        name="ppo-no-zero-grad",
        file="ppo.py",
        tests=REF_PPO,
        what="gradients never zeroed between minibatches: each optimizer step adds all earlier gradients",
        find="                optimizer.zero_grad(set_to_none=True)\n                updates.append([])\n",
        replace="                updates.append([])\n",
    ),
    dict(
        name="ppo-explained-variance-swapped",
        file="ppo.py",
        tests=REF_PPO,
        what="losses/explained_variance called with values and returns swapped",
        find="explained_variance(b_values, b_returns, b_mask, dist.masked_mean)",
        replace="explained_variance(b_returns, b_values, b_mask, dist.masked_mean)",
    ),
    dict(
        name="ppo-explained-variance-unmasked",
        file="common.py",
        tests=["tests/test_loop_wiring.py", "-k", "explained_variance"],
        what="the variance of the returns is taken over padding too",
        find="var_returns = mean((returns - mean(returns, mask)) ** 2, mask)",
        replace="var_returns = ((returns - mean(returns, mask)) ** 2).mean()",
    ),
    dict(
        name="ppo-stats-epochs-not-averaged",
        file="common.py",
        tests=REF_PPO,
        what="the logged losses/ add up the optimizer steps of all epochs instead of averaging them",
        find="return {name: value.item() for name, value in zip(names, means.mean(0))}",
        replace="return {name: value.item() for name, value in zip(names, means.sum(0))}",
    ),
    # ---------------------------------------------------------------------------------------- common.py
    dict(
        name="common-eval-accuracy-partial-credit",
        file="common.py",
        tests=EVAL,
        what="eval/accuracy counts any reward above 0 as right",
        find="sum(r >= 1 - 1e-6 for r in rewards)",
        replace="sum(r > 0 for r in rewards)",
    ),
    dict(
        name="common-eval-training-split",
        file="common.py",
        tests=EVAL,
        what="the evaluation runs on the training split",
        find="examples = task.test[:num_examples]",
        replace="examples = task.train[:num_examples]",
    ),
    dict(
        name="common-eval-drops-a-row-per-batch",
        file="common.py",
        tests=EVAL,
        what="each evaluation batch loses its last example (off-by-one slice)",
        find="batch = examples[i : i + batch_size]",
        replace="batch = examples[i : i + batch_size - 1]",
    ),
    dict(
        name="common-eval-samples",
        file="common.py",
        tests=EVAL,
        what="the evaluation samples instead of decoding greedily",
        find="greedy=True, chat_template=chat_template",
        replace="greedy=False, chat_template=chat_template",
    ),
    dict(
        name="common-mask-drops-eos",
        file="common.py",
        tests=REF_GRPO,
        what="the completion mask stops before the EOS instead of including it",
        find="return (torch.arange(T, device=completion_ids.device)[None, :] <= first_eos[:, None]).long()",
        replace="return (torch.arange(T, device=completion_ids.device)[None, :] < first_eos[:, None]).long()",
    ),
    # ---------------------------------------------------------------------------------------- bookkeeping.py
    dict(
        name="bookkeeping-resume-forgets-sampler",
        file="machinery/checkpoints.py",
        tests=RESUME,
        what="a resumed run restarts the prompt order",
        find='        sampler.load_state_dict(state["sampler"])\n',
        replace="",
    ),
    dict(
        name="bookkeeping-tokens-per-train-second",
        file="machinery/bookkeeping.py",
        tests=["tests/test_loop_wiring.py", "-k", "perf"],
        what="perf/tokens_per_second divides by the training time only",
        find="total_tokens / max(sum(seconds.values()), 1e-9)",
        replace='total_tokens / max(seconds.get("train", 0.0), 1e-9)',
    ),
    dict(
        name="bookkeeping-timer-not-cumulative",
        file="machinery/bookkeeping.py",
        tests=["tests/test_loop_wiring.py", "-k", "perf"],
        what="perf/*_seconds keep only the last interval instead of the cumulative time",
        find="self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start",
        replace="self.seconds[name] = time.perf_counter() - start",
    ),
    dict(
        name="bookkeeping-finite-if-any",
        file="machinery/dumps.py",
        tests=["tests/test_loop_wiring.py", "-k", "nan"],
        what="check_finite passes a tensor when any value (not all) is finite",
        find="bool(torch.isfinite(torch.as_tensor(value)).all())",
        replace="bool(torch.isfinite(torch.as_tensor(value)).any())",
    ),
    dict(
        name="bookkeeping-preset-overrides-zero",
        file="machinery/flags.py",
        tests=["tests/test_cli.py", "-k", "hub"],
        what="a field set to another value than its default (or given on the command line) still takes the hub default",
        find="if key not in given and getattr(args, key) == defaults[key]:",
        replace="if True:",
    ),
    dict(
        name="bookkeeping-peak-memory-units",
        file="machinery/bookkeeping.py",
        tests=["tests/test_loop_wiring.py", "-k", "peak_memory"],
        what="perf/peak_memory_gb on a CPU divides KiB by 2**30, as if they were bytes",
        find="return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20",
        replace="return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**30",
    ),
    # ---------------------------------------------------------------------------------------- tasks.py
    dict(
        name="tasks-sampler-with-replacement",
        file="common.py",
        tests=SAMPLER,
        what="the sampler reads the next index without removing it: the same example forever",
        find="batch.append(self.examples[self.order.pop()])",
        replace="batch.append(self.examples[self.order[-1]])",
    ),
    dict(
        name="tasks-sampler-state-alias",
        file="common.py",
        tests=SAMPLER,
        what="state_dict hands out the live order list, which moves on after the checkpoint",
        find='return {"rng": self.rng.getstate(), "order": list(self.order)}',
        replace='return {"rng": self.rng.getstate(), "order": self.order}',
    ),
    dict(
        name="tasks-sampler-rng-not-restored",
        file="common.py",
        tests=SAMPLER,
        what="load_state_dict restores the order but not the RNG: the next pass differs after a resume",
        find='        self.rng.setstate(state["rng"])\n',
        replace="",
    ),
    dict(
        name="tasks-sampler-global-random",
        file="common.py",
        tests=SAMPLER,
        what="the passes are shuffled with the global random module, not the sampler's seeded RNG",
        find="self.rng.shuffle(self.order)",
        replace="random.shuffle(self.order)",
    ),
    dict(
        name="tasks-copy-split-unshuffled",
        file="tasks/__init__.py",
        tests=["tests/test_sampler_and_eval.py::test_a_constant_answer_earns_little_on_the_held_out_split"],
        what="the copy task's strings are not shuffled: the held-out split is 000..099",
        find="        rng.shuffle(strings)\n",
        replace="",
    ),
    dict(
        name="tasks-split-unshuffled",
        file="tasks/__init__.py",
        tests=["tests/test_tasks.py", "-k", "held_out_split"],
        what="split_examples holds out the first 10% of the data as given, not a shuffled 10%",
        find="    random.Random(seed).shuffle(groups)\n",
        replace="",
    ),
    dict(
        name="tasks-copy-reward-denominator",
        file="tasks/rewards.py",
        tests=["tests/test_tasks.py", "-k", "copy"],
        what="copy_reward divides by the answer's length: extra characters cost nothing",
        find="return hits / max(len(answer), len(completion))",
        replace="return hits / len(answer)",
    ),
    # ------------------------------------------ an outside pass: bugs only slow tests, or none, caught before
    dict(
        name="grpo-k3-ratio-detached",
        file="grpo.py",
        tests=GRADIENTS_GRPO,
        what=(
            "the importance weight of the bias-corrected k3 term detached: "
            "same value, the gradient loses kl * grad log p"
        ),
        find="kl_ref = kl_ref * torch.exp(logratio)",
        replace="kl_ref = kl_ref * torch.exp(logratio).detach()",
    ),
    dict(
        name="grpo-zero-grad-per-micro-batch",
        file="grpo.py",
        tests=GRADIENTS_GRPO,
        what="gradients zeroed before every micro-batch: only the last micro-batch's gradient is applied",
        find="                for micro in mb_inds.split(args.micro_batch_size):\n",
        replace=(
            "                for micro in mb_inds.split(args.micro_batch_size):\n"
            "                    optimizer.zero_grad(set_to_none=True)\n"
        ),
    ),
    dict(
        name="grpo-explained-variance-tiled",
        file="grpo.py",
        tests=["tests/test_explained_variance.py"],
        what="the explained variance's baseline tiled with repeat: completions get another group's mean",
        find=".repeat_interleave(args.group_size)",
        replace=".repeat(args.group_size)",
    ),
    dict(
        name="ppo-value-clip-around-current",
        file="ppo.py",
        tests=GRADIENTS_PPO,
        what="the value is clipped around the current value, so the value clip never acts",
        find="v_loss = clipped_value_loss(new_values, old_values, returns, args.cliprange_value)",
        replace="v_loss = clipped_value_loss(new_values, new_values.detach(), returns, args.cliprange_value)",
    ),
    dict(
        name="ppo-one-shuffle-per-step",
        file="common.py",
        tests=GRADIENTS_PPO,
        what="one permutation per step, reused by every epoch: the epochs draw the same minibatches",
        find=(
            "    for _ in range(epochs):\n"
            "        yield from torch.randperm(n, device=device).split(n // num_minibatches)\n"
        ),
        replace=(
            "    perm = torch.randperm(n, device=device)\n"
            "    for _ in range(epochs):\n"
            "        yield from perm.split(n // num_minibatches)\n"
        ),
    ),
    dict(
        name="ppo-minibatch-from-epochs",
        file="ppo.py",
        tests=GRADIENTS_PPO,
        what="the minibatch size computed from --update-epochs (equal defaults hide it)",
        find="common.shuffled_minibatches(N, args.update_epochs, args.num_minibatches, device)",
        replace="common.shuffled_minibatches(N, args.update_epochs, args.update_epochs, device)",
    ),
    dict(
        name="ppo-kl-coef-not-restored",
        file="ppo.py",
        tests=RESUME_EXACT,
        what="a resumed run restarts the adaptive KL coefficient from --kl-coef",
        find='kl_coef = run.state["kl_coef"] if args.resume else args.kl_coef',
        replace="kl_coef = args.kl_coef",
    ),
    dict(
        name="distributed-gradients-averaged",
        file="machinery/distributed.py",
        tests=["tests/test_fsdp_divide.py"],
        what="FSDP keeps its default reduction: gradients averaged over the processes instead of summed",
        find="unit.set_gradient_divide_factor(1.0)",
        replace="pass",
    ),
    dict(
        name="common-decode-first-eos-only",
        file="common.py",
        tests=["tests/test_eos.py"],
        what="only the first of several EOS ids is stripped from the decoded text",
        find="if ids and ids[-1] in eos_ids:",
        replace="if ids and ids[-1] == eos_ids[0]:",
    ),
    dict(
        name="checkpoints-scheduler-not-restored",
        file="machinery/checkpoints.py",
        tests=RESUME_EXACT,
        what="the learning-rate schedule starts over on resume",
        find='        scheduler.load_state_dict(state["scheduler"])\n',
        replace="",
    ),
    dict(
        name="checkpoints-size-only",
        file="machinery/checkpoints.py",
        tests=RESUME_EXACT,
        what="checkpoint files compared by size only",
        find="if now != size or file_digest(path)[1] != digest:",
        replace="if now != size:",
    ),
    dict(
        name="rewards-match-two-non-numbers",
        file="tasks/rewards.py",
        tests=["tests/test_tasks.py", "-k", "match_reward"],
        what="match_reward scores two non-numbers as equal (None == None): any text earns 1 against a text answer",
        find="return float(number is not None and parse_number(completion) == number)",
        replace="return float(parse_number(completion) == number)",
    ),
    dict(
        name="verify-log-prob-tolerance-loose",
        file="verifier/report.py",
        tests=VERIFY_TOLERANCES,
        what="the log-prob tolerance loosened to 1e-2",
        find='"log-probs": ("abs", 1e-5)',
        replace='"log-probs": ("abs", 1e-2)',
    ),
    dict(
        name="verify-reference-never-compared",
        file="verifier/replay.py",
        tests=VERIFY_TOLERANCES,
        what="the reference's log-probs are computed but never compared",
        find=(
            "compare(\n"
            '                report, "log-probs", step, adapter, "token_logprobs", reference, batch["ref_logp"], '
            'mask, "ref_logp"\n'
            "            )"
        ),
        replace="pass",
    ),
    dict(
        name="verify-gradient-not-accumulated",
        file="verifier/replay.py",
        tests=VERIFY_BRANCHES,
        what="GRPO's gradient row calls train_loss on the whole batch: a loss normalised per micro-batch passes it",
        find='args["micro_batch_size"], *counts(whole)',
        replace='len(whole["completion_mask"]), *counts(whole)',
    ),
    dict(
        name="verify-ppo-update-skipped",
        file="verifier/replay.py",
        tests=VERIFY_BRANCHES,
        what="PPO's update row skipped: an optimizer that never steps passes",
        find='    if not hasattr(adapter, "update"):',
        replace='    if not hasattr(adapter, "update") or args["script"] == "ppo":',
    ),
    dict(
        name="verify-pass-line-hides-never-exercised",
        file="verifier/report.py",
        tests=VERIFY_BRANCHES,
        what="the PASS line leaves out the branches the dump never exercised",
        find="        if missed:",
        replace="        if missed and False:",
    ),
    dict(
        name="verify-openrlhf-kl-coefficient",
        file="verifier/adapters/openrlhf.py",
        tests=["tests/test_verify_assembly.py"],
        what="the OpenRLHF adapter hands training_step twice the KL coefficient",
        find='kl_ctl = args.get("beta", 0.0) if grpo else 0.0',
        replace='kl_ctl = 2 * args.get("beta", 0.0) if grpo else 0.0',
    ),
    dict(
        name="gguf-cache-by-path",
        file="machinery/gguf_convert.py",
        tests=["tests/test_gguf_cache.py"],
        what="the conversion cache keyed by the path only: a replaced file keeps the old model",
        find="key = content_key(path)",
        replace="key = hashlib.sha256(path.encode()).hexdigest()[:16]",
    ),
    dict(
        name="gguf-cache-by-size-and-date",
        file="machinery/gguf_convert.py",
        tests=["tests/test_gguf_cache.py"],
        what="the conversion cache keyed by path, size and date: a model copied with the old size and date is not read",
        find="key = content_key(path)",
        replace=(
            'key = hashlib.sha256(f"{path}|{os.path.getsize(path)}|{os.stat(path).st_mtime_ns}".encode())'
            ".hexdigest()[:16]"
        ),
    ),
    dict(
        name="models-tokenizer-eos-dropped",
        file="machinery/models.py",
        tests=["tests/test_eos.py"],
        what="the tokenizer's own EOS is not added to the generation config's EOS ids",
        find="if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:",
        replace="if False:",
    ),
    # ------------------------------ sizes the tests once had equal, and the first and last prefix or position of a loop
    dict(
        name="grpo-dynamic-rows-stride-of-prompts",
        file="grpo.py",
        tests=DYNAMIC,
        what="dynamic sampling's row index steps by prompts_per_step instead of group_size (equal sizes hide it)",
        find="rows = (groups[:, None] * args.group_size + torch.arange(args.group_size))",
        replace="rows = (groups[:, None] * args.prompts_per_step + torch.arange(args.group_size))",
    ),
    dict(
        name="grpo-dynamic-rows-of-prompts",
        file="grpo.py",
        tests=DYNAMIC,
        what="dynamic sampling keeps prompts_per_step rows of each group instead of its group_size rows",
        find="rows = (groups[:, None] * args.group_size + torch.arange(args.group_size))",
        replace="rows = (groups[:, None] * args.group_size + torch.arange(args.prompts_per_step))",
    ),
    dict(
        name="grpo-dynamic-groups-of-prompts",
        file="grpo.py",
        tests=DYNAMIC,
        what="dynamic sampling judges groups of prompts_per_step rows, not group_size, as informative",
        find='informative = informative_groups(batch["rewards"], args.group_size)  # [groups]',
        replace='informative = informative_groups(batch["rewards"], args.prompts_per_step)  # [groups]',
    ),
    dict(
        name="grpo-dynamic-count-from-group-size",
        file="grpo.py",
        tests=DYNAMIC,
        what="dynamic sampling keeps group_size groups instead of prompts_per_step",
        find="sample(), args.prompts_per_step // dist.world_size(), 1",
        replace="sample(), args.group_size // dist.world_size(), 1",
    ),
    dict(
        name="scoring-causal-skips-first-prefix",
        file="machinery/scoring.py",
        tests=CAUSAL,
        what="the causal check never compares the first prefix (one token)",
        find="for k, total in enumerate(totals):",
        replace="for k, total in list(enumerate(totals))[1:]:",
    ),
    dict(
        name="scoring-causal-skips-last-prefix",
        file="machinery/scoring.py",
        tests=CAUSAL,
        what="the causal check never scores the last prefix (all but the last token)",
        find="n = len(ends) - 1  # the last prefix is the completion itself",
        replace="n = len(ends) - 2  # the last prefix is the completion itself",
    ),
    dict(
        name="scoring-causal-skips-last-total",
        file="machinery/scoring.py",
        tests=CAUSAL,
        what="the causal check scores the last prefix but never compares its total",
        find="for k, total in enumerate(totals):",
        replace="for k, total in list(enumerate(totals))[:-1]:",
    ),
    dict(
        name="scoring-causal-checks-first-row",
        file="machinery/scoring.py",
        tests=CAUSAL,
        what="the causal check runs on the batch's first dense completion, not its longest",
        find="i = max(dense, key=lambda i: len(ids[i]))",
        replace="i = dense[0]",
    ),
    dict(
        name="grpo-informative-groups-of-prompts",
        file="grpo.py",
        tests=GROUP_LOGS,
        what="charts/informative_groups counts groups of prompts_per_step rows",
        find="groups = all_scores.view(-1, args.group_size)  # [prompts, G]",
        replace="groups = all_scores.view(-1, args.prompts_per_step)  # [prompts, G]",
    ),
    dict(
        name="grpo-samples-printed-per-prompts",
        file="grpo.py",
        tests=GROUP_LOGS,
        what="--sample-every prints every prompts_per_step-th row, not the first of each group",
        find="common.print_samples(step, sampled, args.group_size, args.sample_every)",
        replace="common.print_samples(step, sampled, args.prompts_per_step, args.sample_every)",
    ),
    dict(
        name="grpo-prompts-of-group-size",
        file="common.py",
        tests=GROUP_LOGS,
        what="each step keeps group_size of its prompts_per_step prompts (more prompts than a group: fewer rows)",
        find="[dist.rows(args.prompts_per_step // dist.world_size())]",
        replace="[dist.rows(getattr(args, 'group_size', args.prompts_per_step) // dist.world_size())]",
    ),
    dict(
        name="grpo-sum-norm-batch-width",
        file="grpo.py",
        tests=["tests/test_grpo.py", "-k", "bias_corrected"],
        what="Dr. GRPO's constant normaliser uses the batch's longest completion instead of max_new_tokens",
        find="args.loss_agg, total_seqs, total_tokens, args.max_new_tokens)",
        replace="args.loss_agg, total_seqs, total_tokens, mask.shape[1])",
    ),
    dict(
        name="ppo-minibatch-from-samples",
        file="ppo.py",
        tests=GRADIENTS_PPO,
        what="the minibatch size computed from --samples-per-prompt instead of --num-minibatches",
        find="common.shuffled_minibatches(N, args.update_epochs, args.num_minibatches, device)",
        replace="common.shuffled_minibatches(N, args.update_epochs, args.samples_per_prompt, device)",
    ),
    dict(
        name="ppo-samples-printed-per-prompts",
        file="ppo.py",
        tests=CONTROLLER,
        what="--sample-every prints every prompts_per_step-th row, not the first of each prompt's samples",
        find="common.print_samples(step, sampled, args.samples_per_prompt, args.sample_every)",
        replace="common.print_samples(step, sampled, args.prompts_per_step, args.sample_every)",
    ),
    dict(
        name="ppo-gae-skips-last-position",
        file="ppo.py",
        tests=["tests/test_ppo.py", "-k", "gae"],
        what="GAE's backward loop starts one position before the end",
        find="for t in reversed(range(T)):",
        replace="for t in reversed(range(T - 1)):",
    ),
    dict(
        name="ppo-gae-skips-first-position",
        file="ppo.py",
        tests=["tests/test_ppo.py", "-k", "gae"],
        what="GAE's backward loop stops before the first position",
        find="for t in reversed(range(T)):",
        replace="for t in reversed(range(1, T)):",
    ),
    dict(
        name="common-generate-last-columns",
        file="common.py",
        tests=["tests/test_generate.py"],
        what="the completion is the last max_new_tokens columns: prompt tokens when every row stops early",
        find="completion_ids = out[:, prompt_ids.shape[1] :]",
        replace="completion_ids = out[:, -max_new_tokens:]",
    ),
    dict(
        name="common-shared-prompt-length-of-completion",
        file="common.py",
        tests=["tests/test_logprobs.py", "-k", "shared_prompt"],
        what="the shared prompt cache is given the completion's width as the prompt's length",
        find="position_ids, input_ids.shape[1] - T)",
        replace="position_ids, T)",
    ),
    dict(
        name="output-head-unchecked",
        file="machinery/output_head.py",
        tests=["tests/test_logit_memory.py", "-k", "own_logits"],
        what="the head is applied apart from the model without checking that its output is the model's logits",
        find="same = hidden is not None and torch.equal(",
        replace="same = True or torch.equal(",
    ),
    dict(
        name="common-head-on-every-position-at-once",
        file="common.py",
        tests=["tests/test_logit_memory.py", "-k", "chunk_at_a_time"],
        what="the head applied apart from the model runs on all of a micro-batch's positions at once",
        find="zip(hidden.split(chunk_tokens), labels.reshape(-1).split(chunk_tokens))",
        replace="zip([hidden], [labels.reshape(-1)])",
    ),
    dict(
        name="startup-keeps-freed-memory-while-recomputing",
        file="machinery/startup.py",
        tests=["tests/test_logit_memory.py", "-k", "keeps_no_freed_memory"],
        what="a policy that recomputes its activations to save memory still keeps a heap that only grows",
        find="    else:  # a heap that only grows buys speed",
        replace="    if True:  # a heap that only grows buys speed",
    ),
    dict(
        name="model-checks-checkpointing-inverted",
        file="machinery/model_checks.py",
        tests=["tests/test_logit_memory.py", "-k", "checkpointing"],
        what="--gradient-checkpointing auto recomputes where the activations are small, not where they are large",
        find="on = activations > max(rest, CHECKPOINTING_FLOOR)",
        replace="on = activations < max(rest, CHECKPOINTING_FLOOR)",
    ),
    dict(
        name="model-checks-micro-batch-uncapped",
        file="machinery/model_checks.py",
        tests=["tests/test_bad_input_numbers_sizes_models.py", "-k", "step_bytes"],
        what="the memory bound counts a micro-batch larger than the batch at its full size",
        find="min(args.micro_batch_size, rows) * args.max_new_tokens",
        replace="args.micro_batch_size * args.max_new_tokens",
    ),
    dict(
        name="model-checks-micro-batch-and-length-swapped",
        file="machinery/model_checks.py",
        tests=["tests/test_bad_input_numbers_sizes_models.py", "-k", "step_bytes"],
        what="the memory bound caps max_new_tokens at the batch's rows instead of the micro-batch",
        find="min(args.micro_batch_size, rows) * args.max_new_tokens",
        replace="min(args.max_new_tokens, rows) * args.micro_batch_size",
    ),
    # ------------------------------ issue 45: sizes equal in every test, training and use, data and verifier rules
    dict(
        name="rm-loss-share-of-micro-batch",
        file="reward_model.py",
        tests=["tests/test_reward_model.py", "-k", "micro_batches_give"],
        what="each micro-batch's Bradley-Terry loss is divided by its own pairs, not the batch's: k micro-batches, k x",
        find='loss = bradley_terry_loss(chosen, rejected, batch["num_pairs"])',
        replace="loss = bradley_terry_loss(chosen, rejected, len(chosen))",
    ),
    dict(
        name="rm-logged-loss-last-micro-batch",
        file="reward_model.py",
        tests=["tests/test_reward_model.py", "-k", "micro_batches_give"],
        what="the logged batch loss is the last micro-batch's share, not the sum of the shares",
        find='sum(terms["loss"].item() for terms in updates)',
        replace='updates[-1]["loss"].item()',
    ),
    dict(
        name="rm-eval-loss-over-micro-batches",
        file="reward_model.py",
        tests=["tests/test_reward_model.py", "-k", "held_out_evaluation"],
        what="the held-out loss is divided by the number of micro-batches, not of pairs",
        find='"eval/bt_loss": bradley_terry_loss(chosen, rejected, len(margin))',
        replace='"eval/bt_loss": bradley_terry_loss(chosen, rejected, -(-len(pairs) // micro_batch_size))',
    ),
    dict(
        name="ppo-kl-horizon-against-prompts",
        file="ppo.py",
        tests=["tests/test_bad_input_flags_and_state.py", "-k", "count_completions"],
        what="--kl-horizon is checked against the prompts of a step, not its completions (prompts x samples)",
        find="args.target_kl is not None and args.kl_horizon < batch_size:",
        replace="args.target_kl is not None and args.kl_horizon < args.prompts_per_step:",
    ),
    dict(
        name="ppo-minibatches-against-prompts",
        file="ppo.py",
        tests=["tests/test_bad_input_flags_and_state.py", "-k", "count_completions"],
        what="--num-minibatches is checked against the prompts per process, not the completions",
        find="per_process = batch_size // dist.world_size()",
        replace="per_process = args.prompts_per_step // dist.world_size()",
    ),
    dict(
        name="model-checks-rows-of-the-whole-batch",
        file="machinery/model_checks.py",
        tests=["tests/test_bad_input_numbers_sizes_models.py", "-k", "per_process_and_under_lora"],
        what="under torchrun the memory bound counts the whole batch's rows on each process, not its own",
        find='getattr(args, "samples_per_prompt", 1)) // world_size\n    width = 4',
        replace='getattr(args, "samples_per_prompt", 1))\n    width = 4',
    ),
    dict(
        name="model-checks-lora-critic-trained",
        file="machinery/model_checks.py",
        tests=["tests/test_bad_input_numbers_sizes_models.py", "-k", "per_process_and_under_lora"],
        what="the memory bound counts a LoRA critic's frozen backbone as trained (16 bytes a parameter, not 4)",
        find="critic = model_bytes(skeleton(critic_config or config, backbone=True), args, True, critic_fallback)",
        replace="critic = model_bytes(skeleton(critic_config or config, backbone=True), None, True, critic_fallback)",
    ),
    dict(
        name="grpo-dynamic-groups-of-all-processes",
        file="grpo.py",
        tests=DYNAMIC,
        what="under torchrun each process waits for the whole step's informative groups, not its share",
        find="sample(), args.prompts_per_step // dist.world_size(), 1",
        replace="sample(), args.prompts_per_step, 1",
    ),
    dict(
        name="reward-inputs-tokenizer-side",
        file="machinery/models.py",
        tests=["tests/test_reward_model.py", "-k", "alone"],
        what="the reward model's inputs are padded on the tokenizer's own side (left) in training, right in scoring",
        find='return tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens',
        replace='return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens',
    ),
    dict(
        name="models-contiguous-head-not-for-trainable",
        file="machinery/models.py",
        tests=["tests/test_models.py", "-k", "contiguous"],
        what="the LM head's contiguous copy is skipped for a trainable head (the policy and a fresh base differ)",
        find="return (args[0].contiguous(), *args[1:])",
        replace="return (args[0] if module.weight.requires_grad else args[0].contiguous(), *args[1:])",
    ),
    dict(
        name="models-contiguous-head-not-for-frozen",
        file="machinery/models.py",
        tests=["tests/test_models.py", "-k", "contiguous"],
        what="the LM head's contiguous copy is skipped for a frozen head (the reference)",
        find="return (args[0].contiguous(), *args[1:])",
        replace="return (args[0].contiguous() if module.weight.requires_grad else args[0], *args[1:])",
    ),
    dict(
        name="ppo-kl-controller-one-process",
        file="ppo.py",
        tests=["tests/test_loop_wiring.py", "-k", "processs"],
        what="the loop feeds the KL controller this process's completions only: the processes' coefficients drift",
        find="kl_coef = next_kl_coef(b_rollout, args, gather=dist.gather)",
        replace="kl_coef = next_kl_coef(b_rollout, args)",
    ),
    dict(
        name="ppo-kl-controller-gather-unused",
        file="ppo.py",
        tests=["tests/test_loop_wiring.py", "-k", "processs"],
        what="next_kl_coef ignores its gather: each process adapts to its own completions' KL and count",
        find='seq_kl = gather((kl_estimate(batch["old_logp"], batch["ref_logp"], "k1")',
        replace='seq_kl = ((kl_estimate(batch["old_logp"], batch["ref_logp"], "k1")',
    ),
    dict(
        name="preferences-redraw-equal-texts-only",
        file="tasks/preferences.py",
        tests=["tests/test_reward_model.py", "-k", "equal_gold"],
        what="the labeller redraws a pair of equal texts, not one of equal gold rewards: coin-flip labels get in",
        find="if not a or not b or gold_a == gold_b:",
        replace="if not a or not b or a == b:",
    ),
    dict(
        name="preferences-empty-completion-kept",
        file="tasks/preferences.py",
        tests=["tests/test_reward_model.py", "-k", "equal_gold"],
        what="the labeller keeps a pair with an empty completion",
        find="if not a or not b or gold_a == gold_b:",
        replace="if gold_a == gold_b:",
    ),
    dict(
        name="preferences-held-out-on-training-prompts",
        file="tasks/preferences.py",
        tests=["tests/test_reward_model.py", "-k", "held_out_prompts"],
        what="the synthetic held-out pairs are drawn on the training prompts",
        find="synthetic_pairs(sample, task.test, max(1, n_pairs // 10), beta, seed + 1)",
        replace="synthetic_pairs(sample, task.train, max(1, n_pairs // 10), beta, seed + 1)",
    ),
    dict(
        name="preferences-split-by-pair",
        file="tasks/preferences.py",
        tests=["tests/test_reward_model.py", "-k", "one_side"],
        what="the JSONL held-out split is keyed by the whole pair: a prompt's pairs land on both sides",
        find='prompt=json.dumps(pair["prompt"])',
        replace='prompt=json.dumps([pair["prompt"], pair["chosen"], pair["rejected"]])',
    ),
    dict(
        name="verify-incomplete-needs-both-missing",
        file="verifier/report.py",
        tests=["tests/test_verify_accept.py", "-k", "alone"],
        what="INCOMPLETE only when the advantages and every loss row are missing: one of them alone passes",
        find='if "advantages" not in compared or not set(compared) & set(LOSS_ROWS):',
        replace='if "advantages" not in compared and not set(compared) & set(LOSS_ROWS):',
    ),
    dict(
        name="verify-signal-read-as-fail",
        file="verifier/isolation.py",
        tests=["tests/test_verify.py", "-k", "outside_an_adapter"],
        what="a child killed by a signal outside an adapter call exits 1 (FAIL), not 128 + N (137: out of memory)",
        find="return 128 - status if status < 0 else max(status, 1)",
        replace="return max(status, 1)",
    ),
    dict(
        name="verify-reference-logprobs-handed",
        file="verifier/replay.py",
        tests=["tests/test_verify_accept.py", "-k", "answer"],
        what="token_logprobs on the reference is handed the reference's log-probs, the answer key of its row",
        find='reference, _ = call(adapter, "token_logprobs", copy.deepcopy(initial).eval(), given, args)',
        replace=(
            'reference, _ = call(adapter, "token_logprobs", copy.deepcopy(initial).eval(), '
            'dict(given, ref_logp=batch["ref_logp"]), args)'
        ),
    ),
    dict(
        name="threads-follow-capped-at-cores",
        file="machinery/threads.py",
        tests=["tests/test_threads.py", "-k", "up_to_torchs_default"],
        what="auto following the idle cores is capped at the cores, not at torch's default number of threads",
        find='FOLLOW.update(cap=min(TORCH_DEFAULT["threads"], cores), last=last)',
        replace="FOLLOW.update(cap=cores, last=last)",
    ),
    # ---------------------------------------------------------------------------------------- peers' adapters
    dict(
        name="skyrl-critic-loss-unweighted",
        file="verifier/adapters/skyrl.py",
        tests=["tests/test_verify_skyrl.py", "-k", "workers_own"],
        what="the SkyRL adapter forgets the worker's micro-batch weight on the critic loss: not SkyRL's assembly",
        find='loss = loss + args["vf_coef"] * critic_loss * microbatch_weight',
        replace='loss = loss + args["vf_coef"] * critic_loss',
    ),
    dict(
        name="skyrl-entropy-bonus-sign",
        file="verifier/adapters/skyrl.py",
        tests=["tests/test_verify_skyrl.py", "-k", "workers_own"],
        what="the SkyRL adapter adds the worker's entropy loss where the worker subtracts it (a penalty on entropy)",
        find='loss = loss - torch_utils.masked_mean(entropy, mask) * args["ent_coef"] * microbatch_weight',
        replace='loss = loss + torch_utils.masked_mean(entropy, mask) * args["ent_coef"] * microbatch_weight',
    ),
    dict(
        name="skyrl-kl-loss-unweighted",
        file="verifier/adapters/skyrl.py",
        tests=["tests/test_verify_skyrl.py", "-k", "workers_own"],
        what="the SkyRL adapter forgets microbatch_weight on the KL loss: each micro-batch adds the whole KL term",
        find='loss = loss + kl_loss * args["beta"] * microbatch_weight',
        replace='loss = loss + kl_loss * args["beta"]',
    ),
    dict(
        name="areal-engine-share-dropped",
        file="verifier/adapters/areal.py",
        tests=["tests/test_verify_areal.py", "-k", "ppo"],
        what="the AReaL adapter forgets the engine's loss weight (a micro-batch's tokens over its minibatch's)",
        find="total = loss * share",
        replace="total = loss",
    ),
    dict(
        name="areal-share-of-sequences",
        file="verifier/adapters/areal.py",
        tests=["tests/test_verify_areal.py", "-k", "engines_own"],
        what="the AReaL adapter weighs a micro-batch by its share of sequences (SkyRL's weight), not of tokens",
        find='share = mask.count_nonzero() / batch["num_tokens"]',
        replace='share = len(mask) / batch["num_seqs"]',
    ),
    dict(
        name="help-names-a-file-elsewhere",
        file="grpo.py",
        tests=["tests/test_layout.py", "-k", "help"],
        what="--help sends the reader to tasks.py, which is tasks/__init__.py",
        find='(see tasks/__init__.py)"""',
        replace='(see tasks.py)"""',
    ),
    dict(
        name="clipfrac-from-a-second-ppo-clip-test",
        file="common.py",
        tests=["tests/test_grpo.py", "-k", "clipfrac"],
        what="losses/clipfrac recomputes the PPO clip from clip_low instead of reading what the loss clipped",
        find='means["clipfrac"] = masked_mean(terms["clipped"].float(), mask)',
        replace='means["clipfrac"] = clip_fraction(terms["logratio"], terms["advantages"], 0.2, 0.2, mask)',
    ),
    dict(
        name="fingerprint-of-four-keys-only",
        file="machinery/checkpoints.py",
        tests=["tests/test_data_fields.py", "-k", "fingerprint"],
        what="the data's fingerprint leaves out a line's other fields: a resume after every margin was rewritten runs",
        find='other = sorted([key, value] for key, value in example.items() if key not in keys and key != "where")',
        replace="other = []",
    ),
    dict(
        name="example-fields-dropped",
        file="common.py",
        tests=["tests/test_data_fields.py", "-k", "reaches"],
        what="the examples' other fields never reach the loss's batch",
        find="return {key: value for key, value in batch.items() if key in inputs or key not in ROLLOUT_KEYS}",
        replace="return {key: value for key, value in batch.items() if key in inputs}",
    ),
    dict(
        name="branch-resumes-in-the-source-folder",
        file="machinery/bookkeeping.py",
        tests=["tests/test_branch.py", "-k", "leaves"],
        what="--resume with another --output-dir continues in the checkpoint's run folder, writing in it",
        find="if args.resume and not checkpoints.branches(args):",
        replace="if args.resume:",
    ),
    dict(
        name="branch-changes-a-fixed-flag",
        file="machinery/checkpoints.py",
        tests=["tests/test_branch.py", "-k", "keeps"],
        what="a branch lets --learning-rate differ, which the restored optimizer state silently overrides",
        find="if key in RESUMABLE_CHANGES or (branch and key not in BRANCH_FIXED):",
        replace="if key in RESUMABLE_CHANGES or branch:",
    ),
    dict(
        name="preferences-probability-overflows",
        file="tasks/preferences.py",
        tests=["tests/test_bad_input_reward_models_and_environment.py", "-k", "label_beta"],
        what="the labeller's probability takes exp() of a large positive number: --label-beta 1e6 is an OverflowError",
        find="return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))",
        replace="return 1 / (1 + math.exp(-x))",
    ),
    dict(
        name="threads-omp-num-threads-unbounded",
        file="machinery/threads.py",
        tests=["tests/test_bad_input_reward_models_and_environment.py", "-k", "omp_num_threads_is_bounded"],
        what="OMP_NUM_THREADS=100000 is accepted: torch's first parallel operation starts that many threads",
        find="and 1 <= int(level) <= 4 * cores for level in levels)",
        replace="and 1 <= int(level) for level in levels)",
    ),
    dict(
        name="threads-omp-nested-levels-unchecked",
        file="machinery/threads.py",
        tests=["tests/test_bad_input_reward_models_and_environment.py", "-k", "omp_num_threads_is_bounded"],
        what="OMP_NUM_THREADS=4,100000: only the first nesting level is checked, a nested region starts 100,000",
        find="for level in levels)",
        replace="for level in levels[:1])",
    ),
    dict(
        name="summary-target-for-a-learnt-reward",
        file="machinery/bookkeeping.py",
        tests=["tests/test_bad_input_reward_models_and_environment.py", "-k", "learnt_reward"],
        what="the summary prints the 0.9 target of the task's scores for a learnt reward, whose scale is its own",
        find='("" if learnt_reward else',
        replace='("" if False else',
    ),
    dict(
        name="preferences-lone-surrogate-passes",
        file="tasks/preferences.py",
        tests=["tests/test_bad_input_reward_models_and_environment.py", "-k", "read_as_written and surrogate"],
        what="a lone surrogate in a pair passes the reading, and fails later as a TypeError",
        find='value.encode("utf-8")',
        replace='value.encode("utf-8", "surrogatepass")',
    ),
    # ---------------------------------------------------------------------------------------- issue 53: tests that
    # tell a rule from its neighbour (asymmetric values, an explicit non-default, both directions, sizes that differ)
    dict(
        name="branch-forgets-kl-coef",
        file="machinery/checkpoints.py",
        tests=["tests/test_branch.py", "-k", "keeps_what_fixes"],
        what="a branch lets --kl-coef differ, which PPO's restored KL controller silently overrides",
        find='"learning_rate critic_learning_rate weight_decay decay_norms_and_biases warmup_steps kl_coef".split()',
        replace='"learning_rate critic_learning_rate weight_decay decay_norms_and_biases warmup_steps".split()',
    ),
    dict(
        name="branched-from-as-given",
        file="machinery/checkpoints.py",
        tests=["tests/test_branch.py", "-k", "continues_in_a_new_folder"],
        what="branched_from.json records --resume as given (relative): it names nothing from another folder",
        find='json.dump({"checkpoint": os.path.abspath(checkpoint)}, f)',
        replace='json.dump({"checkpoint": checkpoint}, f)',
    ),
    dict(
        name="branch-events-from-the-path-as-given",
        file="machinery/checkpoints.py",
        tests=["tests/test_branch.py", "-k", "continues_in_a_new_folder"],
        what="the source's events are looked for beside --resume as given: with a trailing slash none are copied",
        find="source = os.path.dirname(os.path.abspath(checkpoint))",
        replace="source = os.path.dirname(checkpoint)",
    ),
    dict(
        name="branch-refused-by-the-sources-final",
        file="machinery/checkpoints.py",
        tests=["tests/test_branch.py", "-k", "sources_final"],
        what="a branch is refused when the source's folder holds a final model past the checkpoint it never touches",
        find='check_later_results(folder, state["step"], args.num_steps, branch)',
        replace='check_later_results(folder, state["step"], args.num_steps)',
    ),
    dict(
        name="branch-vf-coef-one-way",
        file="machinery/checkpoints.py",
        tests=["tests/test_branch.py", "-k", "critic"],
        what="a branch refuses --vf-coef 0.1 -> 0 but lets 0 -> 0.2 pass: a critic from nowhere",
        find='(saved["vf_coef"] > 0) != (args.vf_coef > 0)',
        replace='saved["vf_coef"] > 0 and args.vf_coef == 0',
    ),
    dict(
        name="branch-at-the-default-output-dir",
        file="machinery/checkpoints.py",
        tests=["tests/test_branch.py", "-k", "default"],
        what="--resume with --output-dir at its default, run from another folder, is read as a branch",
        find="return args.output_dir != default and os.path.abspath(args.output_dir) != run_parent",
        replace="return os.path.abspath(args.output_dir) != run_parent",
    ),
    dict(
        name="branch-output-dir-compared-as-given",
        file="machinery/checkpoints.py",
        tests=["tests/test_branch.py", "-k", "default"],
        what="--output-dir is compared to the checkpoint's folder as given: a relative spelling of it is a branch",
        find="return args.output_dir != default and os.path.abspath(args.output_dir) != run_parent",
        replace="return args.output_dir != default and args.output_dir != run_parent",
    ),
    dict(
        name="launch-number-digits-unbounded",
        file="machinery/distributed.py",
        tests=["tests/test_distributed.py", "-k", "launch_number or launch_is_checked"],
        what="WORLD_SIZE=1000000000 (10 digits) passes the launch check; its 9-digit bound is gone",
        find="if not text.strip().isdigit() or len(text.strip()) > 9:",
        replace="if not text.strip().isdigit():",
    ),
    dict(
        name="launch-rank-may-equal-its-size",
        file="machinery/distributed.py",
        tests=["tests/test_distributed.py", "-k", "launch_number or launch_is_checked"],
        what="RANK 4 of WORLD_SIZE 4 passes: a rank is checked against its count with > instead of >=",
        find="if name in values and values[name] >= values.get(size, 1):",
        replace="if name in values and values[name] > values.get(size, 1):",
    ),
    dict(
        name="launch-node-as-large-as-the-launch-refused",
        file="machinery/distributed.py",
        tests=["tests/test_distributed.py", "-k", "launch_number or launch_is_checked"],
        what="LOCAL_WORLD_SIZE equal to WORLD_SIZE (one node, the usual torchrun launch) is refused",
        find='if values.get("LOCAL_WORLD_SIZE", 1) > values.get("WORLD_SIZE", 1):',
        replace='if values.get("LOCAL_WORLD_SIZE", 1) >= values.get("WORLD_SIZE", 1) > 1:',
    ),
    dict(
        name="parse-error-exit-status-1",
        file="machinery/flags.py",
        tests=["tests/test_cli.py", "-k", "parse_error"],
        what="the parser's usage errors exit 1, the status of a UsageError found later, instead of argparse's 2",
        find="        sys.exit(2)",
        replace="        sys.exit(1)",
    ),
    dict(
        name="jsonl-int64-bound-2-64",
        file="common.py",
        tests=["tests/test_data_fields.py", "-k", "int64"],
        what="a JSONL field of 2**63 is made an int64 tensor: the bound written as 2**64, torch overflows",
        find="all(abs(v) < 2**63 for v in values)",
        replace="all(abs(v) < 2**64 for v in values)",
    ),
    dict(
        name="fingerprint-pairs-keys-by-name",
        file="machinery/checkpoints.py",
        tests=["tests/test_data_fields.py", "-k", "fingerprint"],
        what="the fingerprint's fixed keys lose chosen and rejected: an older reward-model checkpoint fails to resume",
        find='keys = ("prompt", "answer", "chosen", "rejected")  # then',
        replace='keys = ("prompt", "answer")  # then',
    ),
    dict(
        name="fingerprint-fields-in-line-order",
        file="machinery/checkpoints.py",
        tests=["tests/test_data_fields.py", "-k", "fingerprint"],
        what="the other fields enter the fingerprint in the order a line writes them: the same data reordered differs",
        find='other = sorted([key, value] for key, value in example.items() if key not in keys and key != "where")',
        replace='other = [[key, value] for key, value in example.items() if key not in keys and key != "where"]',
    ),
    dict(
        name="rm-checkpointing-read-for-truth",
        file="reward_model.py",
        tests=["tests/test_reward_model.py", "-k", "recomputes"],
        what="reward_model.py reads --gradient-checkpointing for truth: off (a non-empty string) recomputes",
        find='if args.gradient_checkpointing == "on":',
        replace="if args.gradient_checkpointing:",
    ),
    dict(
        name="rm-checkpointing-auto-on",
        file="reward_model.py",
        tests=["tests/test_reward_model.py", "-k", "recomputes"],
        what="reward_model.py's --gradient-checkpointing auto recomputes, though its memory bound counts activations",
        find='if args.gradient_checkpointing == "on":',
        replace='if args.gradient_checkpointing != "off":',
    ),
    dict(
        name="rm-scheduler-steps-before-the-rate-is-logged",
        file="reward_model.py",
        tests=["tests/test_reward_model.py", "-k", "logged_rate"],
        what="reward_model.py steps the scheduler before logging: under warmup it logs the next step's rate",
        find=(
            "        scalars = {\n"
            '            "charts/accuracy": (margins > 0).float().mean(),\n'
            '            "charts/margin": margins.mean(),\n'
            '            "charts/learning_rate": optimizer.param_groups[0]["lr"],\n'
            "        }\n"
            "        if (args.eval_every and step % args.eval_every == 0) or step == args.num_steps:\n"
            '            history["eval"] = evaluate(model, tokenizer, task.test, '
            "args.micro_batch_size, device, dtype)\n"
            '            scalars.update(history["eval"])\n'
            '        losses = {"bt_loss": b_loss, "grad_norm": grad_norms["reward_model"]}\n'
            '        bookkeeping.log_step(writer, step, scalars, losses, timer, history["tokens"], device)\n'
            "        scheduler.step()  # after logging the rate this step's update used\n"
        ),
        replace=(
            "        scheduler.step()\n"
            "        scalars = {\n"
            '            "charts/accuracy": (margins > 0).float().mean(),\n'
            '            "charts/margin": margins.mean(),\n'
            '            "charts/learning_rate": optimizer.param_groups[0]["lr"],\n'
            "        }\n"
            "        if (args.eval_every and step % args.eval_every == 0) or step == args.num_steps:\n"
            '            history["eval"] = evaluate(model, tokenizer, task.test, '
            "args.micro_batch_size, device, dtype)\n"
            '            scalars.update(history["eval"])\n'
            '        losses = {"bt_loss": b_loss, "grad_norm": grad_norms["reward_model"]}\n'
            '        bookkeeping.log_step(writer, step, scalars, losses, timer, history["tokens"], device)\n'
        ),
    ),
    dict(
        name="rm-tokens-with-padding",
        file="reward_model.py",
        tests=["tests/test_reward_model.py", "-k", "logged_rate"],
        what="reward_model.py's tokens a second count each micro-batch's padding too",
        find='history["tokens"] += sum(int(enc["attention_mask"].sum()) for enc in micro_inputs)',
        replace='history["tokens"] += sum(enc["attention_mask"].numel() for enc in micro_inputs)',
    ),
    dict(
        name="rm-tokens-of-the-first-micro-batch",
        file="reward_model.py",
        tests=["tests/test_reward_model.py", "-k", "logged_rate"],
        what="reward_model.py's tokens a second count one micro-batch's tokens as the step's",
        find='history["tokens"] += sum(int(enc["attention_mask"].sum()) for enc in micro_inputs)',
        replace='history["tokens"] += len(micro_inputs) * int(micro_inputs[0]["attention_mask"].sum())',
    ),
]
