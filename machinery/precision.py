"""The device of a run, and the precision of its forward passes (--dtype): what `auto` picks here, and why.

The trained weights stay float32 in every case (the master copy, see common.autocast); --dtype only sets the
dtype the forward passes autocast to. bfloat16 halves the bytes a matmul moves and, where the hardware multiplies
bf16 natively, doubles its throughput (one thread of an AVX-512 BF16 CPU: 209 GFLOP/s against 94 in float32); a
GRPO step of SmolLM2-135M takes 0.67x the float32 time (benchmarks/dtype_speed.py). Where bf16 is emulated it is
slower than float32, so `auto` asks the hardware first.
"""

import contextlib

import torch

from machinery import distributed as dist
from machinery.errors import UsageError
from machinery.models import TINY_MODELS

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def native_bf16(device):
    """The bf16 matmul this device runs natively, named (truthy), or None: on CUDA, whether the GPU has bf16
    (Ampere on) without emulation; on a CPU, AMX or AVX-512 BF16 as torch's own CPU probe reports them, and only
    with oneDNN, which is what runs bf16 matmuls on a CPU."""
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else None
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX-512 BF16"
    return None


def choose_dtype(name, device_type, native, model_name):
    """(dtype, reason) for --dtype `name` on a `device_type` device whose native bf16 is `native` (native_bf16).

    auto: bfloat16 where the hardware multiplies it natively, a GPU or a CPU with AVX-512 BF16 or AMX (learning
    measured unchanged on a real model: docs/real_model.md), float32 elsewhere, and for the
    built-in tiny model on a CPU. float16 is refused: without loss scaling, gradients below ~6e-8 underflow to 0.
    """
    if name == "float16":
        raise UsageError(
            "--dtype float16 would need loss scaling, which this project does not do: use --dtype bfloat16 or float32"
        )
    if name != "auto":
        return DTYPES[name], f"--dtype {name}"
    if native and device_type == "cuda":
        return torch.bfloat16, "auto: this GPU computes bfloat16"
    if device_type == "cpu" and model_name in TINY_MODELS:
        return torch.float32, "auto: the built-in tiny model runs in float32 on a CPU (its step is not matmuls)"
    if native and device_type == "cpu":
        return torch.bfloat16, f"auto: this CPU computes bfloat16 natively ({native}); --dtype float32 for float32"
    if device_type == "cpu":
        return torch.float32, "auto: this CPU has neither AVX-512 BF16 nor AMX: bfloat16 would be emulated, slower"
    return torch.float32, f"auto: this {device_type} device has no native bfloat16"


def resolve_dtype(name, device, model_name=None):
    """The autocast dtype of a run on `device`, printed at start with the reason (by the main process)."""
    dtype, reason = choose_dtype(name, device.type, native_bf16(device), model_name)
    if dist.is_main():
        print(f"dtype: {str(dtype).removeprefix('torch.')} ({reason})")
    return dtype


def activation_checkpointing(model):
    """Whether the model recomputes its activations in the backward pass (transformers 5 renamed the flag)."""
    flag = next((f for f in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(model, f)), None)
    return bool(flag and getattr(model, flag))


def set_activation_checkpointing(model, on):
    """Recompute activations in the backward pass (non-reentrant), or stop; transformers 5 renamed the methods."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            {"use_reentrant": False}
        ) if on else model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def sdpa_under_cpu_bf16(model, device):
    """Whether `model` attends by torch's fused kernel (SDPA) on a CPU (its inputs on `device`) under bfloat16
    autocast, where that kernel is slow (decoding_attention, log_prob_attention), and can be switched."""
    return (
        getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"
        and hasattr(model, "set_attn_implementation")
        and device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
    )


FLOAT32_SDPA = "sdpa_float32"  # the name transformers knows float32_sdpa by (registered on first use)


def float32_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with its inputs in float32 and autocast off; the output in the query's dtype."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(query.device.type, enabled=False):
        output, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return output.to(query.dtype), weights


@contextlib.contextmanager
def log_prob_attention(model, device):
    """token_logprobs' forward (its inputs on `device`) attends in float32 (float32_sdpa) on a CPU under bfloat16
    autocast, where torch's fused kernel takes 3x its float32 time in the backward pass (SmolLM2, a layer of 8 rows:
    2.1 ms against 0.7); the matmuls around it stay bf16. Every log-prob of a step (policy, reference, old policy)
    is computed here, so they agree with each other to the bit as before."""
    # Not with activation checkpointing: its backward runs the layer again, after this context, as it was.
    switch = sdpa_under_cpu_bf16(model, device) and not activation_checkpointing(model)
    if switch:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(FLOAT32_SDPA, float32_sdpa)
        AttentionMaskInterface.register(FLOAT32_SDPA, sdpa_mask)
        try:
            model.set_attn_implementation(FLOAT32_SDPA)
        except (ValueError, NotImplementedError):  # a model without transformers' attention interface: as it was
            model.set_attn_implementation("sdpa")
        switch = model.config._attn_implementation == FLOAT32_SDPA
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation("sdpa")


PLAIN_ATTENTION_MAX = 2**24  # values of one layer's attention weights while generating: past it, SDPA stays


@contextlib.contextmanager
def decoding_attention(model, prompt_ids, new_tokens):
    """generate() attends by plain matmuls ("eager") instead of torch's fused kernel (SDPA) where that is faster:
    on a CPU under bfloat16 autocast, whose SDPA takes 4-5x its float32 time for one new token over a short cache
    (docs/real_model.md: the CPU's limit), while the prompt's attention weights (rows x heads x length^2) stay
    under PLAIN_ATTENTION_MAX values. Sampling only: every log-prob of the step (policy, reference, old policy) is
    computed by token_logprobs with one kernel (log_prob_attention), so they agree with each other to the bit."""
    rows, length = prompt_ids.shape[0], prompt_ids.shape[1] + new_tokens
    plain = (
        sdpa_under_cpu_bf16(model, prompt_ids.device)
        and rows * getattr(model.config, "num_attention_heads", 1) * length**2 <= PLAIN_ATTENTION_MAX
    )
    if plain:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if plain:
            model.set_attn_implementation("sdpa")


@contextlib.contextmanager
def generation_mode(model):
    """Eval mode, and activation checkpointing off: it forces use_cache=False, making decoding quadratic."""
    was_training, was_checkpointing = model.training, activation_checkpointing(model)
    if was_checkpointing:
        set_activation_checkpointing(model, False)
    model.eval()
    try:
        yield
    finally:
        if was_checkpointing:
            set_activation_checkpointing(model, True)
        model.train(was_training)
