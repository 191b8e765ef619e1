"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") for grpo.py and ppo.py, through peft.

With --lora-rank R > 0, every targeted linear layer W of the policy (and of PPO's critic) is frozen and learns a
low-rank update instead: y = W x + (alpha / R) B A x, with A [R, in] drawn at random and B [out, R] zero, so the
adapted model starts as exactly the base model. Only A and B (and PPO's value head) are trained, so AdamW's 16
bytes per trained parameter apply to them alone; the frozen base costs its 4 bytes (float32) per parameter.

  - The reference is the policy with its adapters switched off (Reference): the frozen base itself, no second
    copy of the weights. At step 1 (B = 0) both compute the same log-probs, so the KL is exactly 0; the base
    never trains, so the reference never moves.
  - PPO's critic gets its own adapters on its own frozen copy of the base (why: docs/lora_and_memory.md).
  - A model's save_pretrained then writes its adapters alone, in peft's format, so every save (checkpoints, the
    final model, the critic's backbone) goes on as it is: `PeftModel.from_pretrained(base, folder)` loads them.
    --lora-merged also writes the policy with B A added into W, a plain transformers model (save_merged).
  - A is drawn from a generator seeded by --seed: verify.py rebuilds the same initial adapters from a dump's args.

peft is imported only when --lora-rank > 0 (pip install -r requirements/lora.txt).
"""

import contextlib
import os
import types

import torch

from machinery import distributed as dist
from machinery import model_checks, models
from machinery.errors import UsageError

ADAPTER_FILE = "adapter_model.safetensors"  # peft's names, so PeftModel.from_pretrained reads the folder
PREFIX = "base_model.model."  # the key prefix of a PeftModel's own state dict, which peft's files keep


def _arg(args, name, default=None):
    """A flag of `args`: the run's Args, or a dump's args as a dict (whose runs may predate the LoRA flags)."""
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)


def import_peft():
    try:
        import peft
    except ImportError:
        message = "--lora-rank needs peft, which is not installed: pip install -r requirements/lora.txt"
        raise UsageError(message) from None
    return peft


LORA_FLAGS = ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_merged")  # they act only with --lora-rank


def check_args(args):
    """One line for LoRA flags that cannot work: a rank below 0, an alpha or dropout out of range, no target
    modules, LoRA under torchrun, or a LoRA flag set away from its default without --lora-rank (it could not
    act; passing the default itself changes nothing)."""
    if args.lora_rank < 0:
        raise UsageError(f"--lora-rank is {args.lora_rank}: it must be a positive integer (0: full fine-tuning)")
    if args.lora_rank == 0:
        for name in LORA_FLAGS:
            value = tuple(getattr(args, name)) if name == "lora_target_modules" else getattr(args, name)  # or a list
            if value != getattr(type(args), name):
                shown = " ".join(value) if isinstance(value, tuple) else "" if isinstance(value, bool) else value
                raise UsageError(
                    f"--{name.replace('_', '-')} {shown}".strip() + " acts only on LoRA adapters, and --lora-rank "
                    "is 0 (every weight trains): add --lora-rank (16, say), or drop the flag"
                )
        return
    if not args.lora_alpha > 0:
        raise UsageError(f"--lora-alpha is {args.lora_alpha}: it must be > 0 (the update is alpha / rank * B A)")
    if not 0 <= args.lora_dropout < 1:
        raise UsageError(f"--lora-dropout is {args.lora_dropout}: it must be in [0, 1)")
    if not args.lora_target_modules or not all(name.strip() for name in args.lora_target_modules):
        raise UsageError("--lora-target-modules is empty: name modules (q_proj v_proj ...) or keep all-linear")
    if dist.world_size() > 1:
        raise UsageError(
            "--lora-rank under torchrun is not supported: the reference (the policy with its adapters off) and the "
            "adapter-only checkpoints are not wired to FSDP2's shards; run LoRA on one process (one GPU holds "
            "a 7B policy with LoRA, docs/lora_and_memory.md)"
        )
    import_peft()


def check_layers(args, model, name, flag="--model", critic=False):
    """Before any weight loads, on the model's skeleton (model_checks.skeleton; None: not checked here): refuse a
    --lora-target-modules name that matches no layer peft can adapt (peft would adapt the others and drop it
    silently), naming the layers there are; an adapter on an input embedding tied to the output head, or on that
    head (peft unties the pair: the saved or merged model would not compute what was trained); and a --lora-rank
    above what any adapted layer can use (B A of a layer [out, in] has rank at most min(out, in); a larger one
    only allocates). A `critic`'s backbone has no output head: its names are checked on the policy."""
    if not args.lora_rank or model is None:
        return
    targets = tuple(args.lora_target_modules)
    layers = model_checks.adapted_layers(model, targets)
    for target in targets if targets != ("all-linear",) and not critic else ():
        if not any(model_checks.targeted(layer, [target]) for layer in layers):
            raise UsageError(
                f"--lora-target-modules {target} names no linear or embedding layer of {flag} {name!r}: its "
                f"linear layers are {' '.join(linear_names(model))}; fix the name, or keep all-linear"
            )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is model.get_input_embeddings().weight  # tie_word_embeddings
    pair = [key for key, layer in layers.items() if tied and layer in (head, model.get_input_embeddings())]
    if pair:
        raise UsageError(
            f"--lora-target-modules adapts {pair[0]}, which {name!r} ties to its input embedding or output head "
            "(tie_word_embeddings): an adapter unties the pair, so the saved and merged models would not be the "
            "trained one: adapt its linear layers (keep all-linear, or name them)"
        )
    most = max((min(module.weight.shape) for module in layers.values()), default=args.lora_rank)
    if args.lora_rank > most:
        raise UsageError(
            f"--lora-rank {args.lora_rank} is more than {most}, the highest rank any adapted layer of {flag} {name!r} "
            f"can use (B A of a layer [out, in] has rank at most min(out, in)): pass at most {most} (8 to 64 is usual)"
        )


def lora_config(args, task_type):
    peft = import_peft()
    targets = list(_arg(args, "lora_target_modules", ("all-linear",)))
    return peft.LoraConfig(
        r=_arg(args, "lora_rank"),
        lora_alpha=_arg(args, "lora_alpha"),
        lora_dropout=_arg(args, "lora_dropout", 0.0),
        target_modules=targets[0] if targets == ["all-linear"] else targets,
        bias="none",
        task_type=task_type,
    )


def linear_names(model):
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    linears = [name for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))]
    return sorted({name.rsplit(".", 1)[-1] for name in linears})


def wrap(model, args, task_type="CAUSAL_LM"):
    """`model` with LoRA adapters injected in place, they alone trainable, and save_pretrained writing them alone;
    with --lora-rank 0, `model` as it is. task_type: peft's name of the model's kind (None: a critic's backbone)."""
    if not _arg(args, "lora_rank", 0):
        return model
    peft = import_peft()
    config = lora_config(args, task_type)
    config.base_model_name_or_path = getattr(model, "name_or_path", None)  # the folder it was loaded from
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_arg(args, "seed"))  # the same initial A on every run of this seed (and in verify.py)
        try:
            peft.inject_adapter_in_model(config, model)
        except (ValueError, TypeError, NotImplementedError) as e:
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(
                f"--lora-target-modules {' '.join(_arg(args, 'lora_target_modules'))}: peft cannot adapt "
                f"{type(model).__name__} so ({first_line[:160]}); its linear layers are {' '.join(linear_names(model))}"
            ) from None
    model.save_pretrained = types.MethodType(save_adapters, model)
    return model


def has_adapters(model):
    return any("lora_A" in name for name, _ in model.named_parameters())


def save_adapters(model, folder, state_dict=None, **kwargs):
    """The adapters of `model` (from `state_dict` if given, under the model's own names) into `folder` as peft
    writes them: adapter_config.json and adapter_model.safetensors."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapters = get_peft_model_state_dict(model, state_dict=state_dict)  # lora_A/lora_B only, the adapter's name dropped
    os.makedirs(folder, exist_ok=True)
    save_file(
        {PREFIX + key: value.detach().cpu().contiguous() for key, value in adapters.items()},
        os.path.join(folder, ADAPTER_FILE),
    )
    model.peft_config["default"].save_pretrained(folder)


def load_adapters(model, folder):
    """The adapters saved by save_adapters in `folder` into `model`, which has the same ones (wrap)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = os.path.join(folder, ADAPTER_FILE)
    if not os.path.isfile(path):
        raise UsageError(f"--resume: {folder} holds no LoRA adapters ({ADAPTER_FILE}): it is not a LoRA checkpoint")
    saved = {key.removeprefix(PREFIX): value for key, value in load_file(path).items()}
    result = set_peft_model_state_dict(model, saved)
    if result.unexpected_keys:
        raise UsageError(
            f"--resume: the adapters in {folder} do not fit this model ({result.unexpected_keys[0]}): "
            "pass the checkpoint's --model and --lora-* flags"
        )


def restore_weights(model, folder, load):
    """A checkpoint's weights into `model`: with LoRA its adapters (and a critic's value head, saved beside them;
    the frozen base is the one --model loaded), else the whole model as `load(folder, models.CPU)` reads it."""
    if not has_adapters(model):
        return dist.load_state_dict(model, load(folder, models.CPU).state_dict())
    load_adapters(getattr(model, "backbone", model), folder)
    if hasattr(model, "value_head"):
        models.load_head(model.value_head, folder, next(model.parameters()).device)


@contextlib.contextmanager
def adapters_off(model):
    """Every adapter of `model` switched off meanwhile: the model computes what its frozen base does."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # also makes the adapters trainable again


class Reference:
    """The policy with its adapters off, called as a model is: the frozen base, with no weights of its own (the
    log's charts/params_reference counts 0)."""

    def __init__(self, policy):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with adapters_off(self.policy):
            return self.policy(*args, **kwargs)

    def parameters(self):
        return iter(())

    def __getattr__(self, name):  # config, forward, generation_config...: the policy's, read, never trained
        return getattr(self.policy, name)


def reference(policy, args, device):
    """The frozen reference of the KL term: with LoRA the policy with its adapters off (no copy), else a second
    copy of --model, held like the policy (float32 weights, the same autocast) so that the step-1 KL is 0."""
    if args.lora_rank:
        return Reference(policy)
    return models.load_causal_lm(args.model, device).eval().requires_grad_(False)


def merged_state_dict(model):
    """The state dict of the plain model that computes what `model` does: each adapted W replaced by
    W + (alpha / rank) B A, under its name without LoRA (what AutoModelForCausalLM.from_pretrained reads)."""
    from peft.tuners.lora import LoraLayer

    state_dict = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            prefix = f"{name}." if name else ""
            with torch.no_grad():
                weight = module.get_base_layer().weight + module.get_delta_weight("default")
            state_dict[prefix + "weight"] = weight.detach()
            if getattr(module.get_base_layer(), "bias", None) is not None:  # an embedding has none
                state_dict[prefix + "bias"] = module.get_base_layer().bias.detach()
    for key, value in model.state_dict().items():
        if "lora_" not in key and ".base_layer." not in key:
            state_dict[key] = value
    return state_dict


def save_final(policy, tokenizer, run_dir, args):
    """The run's final policy: run_dir/final as checkpoints.save_model writes it (with LoRA: its adapters), and with
    --lora-merged run_dir/final-merged (save_merged). Returns the final folder."""
    from machinery import checkpoints

    final_dir = os.path.join(run_dir, "final")
    checkpoints.save_model(policy, tokenizer, final_dir, step=args.num_steps)
    save_merged(policy, tokenizer, final_dir + "-merged", args)
    return final_dir


def save_merged(policy, tokenizer, folder, args):
    """With --lora-merged: the policy merged into its base as a plain transformers model in `folder`."""
    if not args.lora_merged:
        return
    from machinery import checkpoints

    merged = types.SimpleNamespace(
        save_pretrained=lambda path, state_dict=None: type(policy).save_pretrained(
            policy, path, state_dict=merged_state_dict(policy)
        ),
        parameters=policy.parameters,
    )
    checkpoints.save_model(merged, tokenizer, folder)
