"""Shared fixtures: a private model cache, the built-in tiny model, and a small random model with sharp logits.

Tests marked `exact` make a bit-for-bit claim (a seed reproduces, a resume is the uninterrupted run, the reference is
the base model, step 1's KL is 0). docs/testing.md lists them, the CPU kernel paths they were checked on, and how
to run the suite on another path (MKL_CBWR=COMPATIBLE, MKL_ENABLE_INSTRUCTIONS=AVX2, ...).
"""

import os

import pytest
import torch

collect_ignore = ["mutants"]  # tests/mutants/run.py seeds bugs and runs selections of this suite: never part of it


@pytest.fixture(scope="session", autouse=True)
def xdg_cache(tmp_path_factory):
    """Every test (and every subprocess it starts) builds and reads the tiny model here, never in ~/.cache."""
    folder = str(tmp_path_factory.mktemp("xdg-cache"))
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = folder
    yield folder
    if old is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """These models are tiny: a second thread gains nothing, and on a shared 2-core machine it makes the suite 4x
    slower. OMP_NUM_THREADS too: the scripts' --threads auto keeps it (machinery/threads.py)."""
    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if env is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(scope="session", autouse=True)
def float32_on_every_cpu():
    """--dtype auto answers float32 on every CPU here, so what a test computes does not depend on the CPU's
    instruction set (AVX-512 BF16 or not); tests of bfloat16 ask for it, tests of auto's choice call choose_dtype."""
    from machinery import precision

    with pytest.MonkeyPatch.context() as patch:
        real = precision.native_bf16
        pinned = lambda device: None if device.type == "cpu" else real(device)
        pinned.__wrapped__ = real  # for the tests of the probe itself
        patch.setattr(precision, "native_bf16", pinned)
        yield


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from machinery import models
    from machinery.tiny_model import TINY_MODEL

    return models.load_tokenizer(TINY_MODEL)


@pytest.fixture(scope="session")
def tiny_model():
    from machinery import models
    from machinery.tiny_model import TINY_MODEL

    return models.load_causal_lm(TINY_MODEL, torch.device("cpu")).eval()


def make_small_model(kind="qwen2", seed=0, **overrides):
    """A 2-layer random model with a wide init, so its logits differ a lot between tokens and positions.

    The built-in tiny model's init gives nearly uniform logits, against which an off-by-one or a
    missing temperature would hide inside the tolerance. `qwen2` has rotary positions, `gpt2`
    absolute ones: only there does a wrong position id under left padding change the output.
    """
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    if kind == "qwen2":
        config = dict(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=0.5,
            tie_word_embeddings=False,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=None,
        )
        config_cls, model_cls = Qwen2Config, Qwen2ForCausalLM
    else:
        config = dict(
            vocab_size=32,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            initializer_range=0.5,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=None,
        )
        config_cls, model_cls = GPT2Config, GPT2LMHeadModel
    config.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**config)).eval()


@pytest.fixture(params=["qwen2", "gpt2"])
def small_model(request):
    return make_small_model(request.param)


@pytest.fixture(scope="session")
def verify_dumps(tmp_path_factory):
    """verify.py's recommended dumps (grpo, ppo: every branch of every row exercised, on tiny-gpt2) and a one-step
    GRPO dump of the tiny model at the defaults (plain: ratio 1, KL 0), made once for every verify test."""
    from verify_helpers import GRPO_RECIPE, PLAIN, PPO_RECIPE, make_dump

    folder = tmp_path_factory.mktemp("verify-dumps")
    return {
        "grpo": make_dump(folder, "grpo", **GRPO_RECIPE),
        "ppo": make_dump(folder, "ppo", **PPO_RECIPE),
        "plain": make_dump(tmp_path_factory.mktemp("plain"), "grpo", **PLAIN),
    }
