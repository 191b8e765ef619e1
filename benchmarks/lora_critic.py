"""PPO's critic under LoRA, two designs measured side by side: memory and correctness.

  own   (what ppo.py does): the critic is a value head on its own copy of the base backbone (AutoModel), frozen,
        with its own adapters. One more frozen copy of the base: 4 bytes per parameter (float32).
  shared: the critic is a value head on the policy's own backbone (the CausalLM's inner model), frozen and shared,
        with a second set of adapters ("critic") switched on for the critic's forward and off for the policy's.

Each design runs in its own process (so its peak memory is its own): build the policy and the critic, then one
PPO-style micro-batch (the policy's log-probs and the critic's values on the same batch, one backward of
policy loss + value loss). It reports the bytes of weights (frozen, trained), the peak RSS, the values, and the
gradients: the policy's adapters and the critic's must get the same gradients in both designs, and in `shared`
the value loss alone must leave the policy's adapters without gradient.

    OMP_NUM_THREADS=1 python benchmarks/lora_critic.py --model tiny            # both designs, then the comparison
    OMP_NUM_THREADS=1 python benchmarks/lora_critic.py --model FILE.gguf --batch 8
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def set_active(model, name):
    """The adapter `name` alone active in every LoRA layer, without peft's set_adapter (which also flips
    requires_grad, and so would change the leaves of a graph already built by the other model's forward)."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module._active_adapter = [name]


def build(design, model_name, rank):
    import torch

    import ppo
    from machinery import lora, models
    from machinery.critic import Critic

    args = types.SimpleNamespace(
        model=model_name, seed=1, lora_rank=rank, lora_alpha=32.0, lora_dropout=0.0, lora_target_modules=("all-linear",)
    )
    policy = lora.wrap(models.load_causal_lm(model_name, models.CPU), args)
    if design == "own":
        critic = ppo.load_critic(model_name, models.CPU)
        lora.wrap(critic.backbone, args, task_type=None)
        return policy, critic, lambda: None, lambda: None
    import peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)  # the same initial A as `own`'s critic adapters (wrap seeds with --seed)
        peft.inject_adapter_in_model(lora.lora_config(args, None), policy, adapter_name="critic")
    critic = Critic(policy.model)  # the policy's backbone, shared; its value head alone is new
    trained = [p for n, p in policy.named_parameters() if ".critic." in n] + list(critic.value_head.parameters())
    for p in trained:
        p.requires_grad_(True)
    critic.parameters = lambda recurse=True: iter(trained)  # the critic trains its adapters and head only
    return policy, critic, lambda: set_active(policy, "default"), lambda: set_active(policy, "critic")


def measure(design, model_name, rank, batch, tokens):
    import torch

    import common
    import ppo

    torch.manual_seed(0)
    policy, critic, policy_on, critic_on = build(design, model_name, rank)
    with torch.no_grad():  # a head of 0 (ppo.py's init) would pass no gradient to the critic's adapters
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    vocab = policy.config.vocab_size
    input_ids = torch.randint(3, vocab, (batch, tokens))
    attention_mask, mask = torch.ones_like(input_ids), torch.ones(batch, tokens // 2)
    policy_on()
    logp = common.token_logprobs(policy, input_ids, attention_mask, mask, 1.0)
    critic_on()
    values = ppo.token_values(critic, input_ids, attention_mask, mask)
    policy_on()
    loss = -logp.mean() + ((values - 1.0) ** 2).mean()
    loss.backward()
    grads = lambda names: {n: p.grad.clone() for n, p in names if p.grad is not None}
    policy_grads = grads((n, p) for n, p in policy.named_parameters() if "lora_" in n and ".critic." not in n)
    critic_grads = grads(
        (n, p)
        for n, p in critic.named_parameters()
        if (".critic." in n or "value_head" in n or (design == "own" and "lora_" in n))
    )
    everything = {id(p): p for m in (policy, critic.backbone, critic.value_head) for p in m.parameters()}.values()
    frozen = sum(p.numel() * p.element_size() for p in everything if not p.requires_grad)
    trained = sum(p.numel() * p.element_size() for p in everything if p.requires_grad)
    norm = lambda g: float(torch.sqrt(sum((v.double() ** 2).sum() for v in g.values())))
    return dict(
        design=design,
        frozen_bytes=frozen,
        trained_bytes=trained,
        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        values_sum=float(values.sum()),
        logp_sum=float(logp.sum()),
        policy_grad_norm=norm(policy_grads),
        critic_grad_norm=norm(critic_grads),
        policy_grad_tensors=len(policy_grads),
        critic_grad_tensors=len(critic_grads),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, a hub id, a folder or a .gguf file")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--design", choices=["own", "shared"], help="measure one design here (else both, each apart)")
    args = parser.parse_args()
    if args.design:
        print(json.dumps(measure(args.design, args.model, args.rank, args.batch, args.tokens)))
        return
    results = []
    for design in ("own", "shared"):
        command = [
            sys.executable,
            __file__,
            "--design",
            design,
            "--model",
            args.model,
            "--rank",
            str(args.rank),
            "--batch",
            str(args.batch),
            "--tokens",
            str(args.tokens),
        ]
        out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        print(
            f"{r['design']:6}  frozen {r['frozen_bytes'] / 2**30:.3f} GiB  "
            f"trained {r['trained_bytes'] / 2**20:.1f} MiB  "
            f"peak RSS {r['peak_rss_gb']:.2f} GB  values {r['values_sum']:.6f}  log-probs {r['logp_sum']:.4f}  "
            f"grad norms policy {r['policy_grad_norm']:.6e} ({r['policy_grad_tensors']})  "
            f"critic {r['critic_grad_norm']:.6e} ({r['critic_grad_tensors']})"
        )


if __name__ == "__main__":
    main()
