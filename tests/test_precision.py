"""--dtype auto: bfloat16 on a GPU or CPU that multiplies it natively, float32 elsewhere, the reason printed; the
choice is a pure function of what the hardware reports, so every case is tested here on any machine."""

import shutil

import pytest
import torch

import grpo
from machinery import precision
from machinery.errors import UsageError
from machinery.tiny_model import TINY_MODEL

BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize(
    "name, device, native, model, expected, reason",
    [
        ("auto", "cpu", "AVX-512 BF16", "org/model", BF16, "this CPU computes bfloat16 natively (AVX-512 BF16)"),
        ("auto", "cpu", "AMX", "model.gguf", BF16, "natively (AMX); --dtype float32 for float32"),
        ("auto", "cpu", None, "org/model", F32, "neither AVX-512 BF16 nor AMX"),
        ("auto", "cpu", "AVX-512 BF16", TINY_MODEL, F32, "tiny model runs in float32"),
        ("auto", "cuda", "bfloat16", TINY_MODEL, BF16, "this GPU computes bfloat16"),
        ("auto", "cuda", None, "org/model", F32, "no native bfloat16"),
        ("auto", "mps", None, "org/model", F32, "no native bfloat16"),
        ("float32", "cpu", "AVX-512 BF16", "org/model", F32, "--dtype float32"),  # an explicit --dtype wins
        ("bfloat16", "cpu", None, "org/model", BF16, "--dtype bfloat16"),
    ],
)
def test_auto_follows_the_hardware_and_an_explicit_dtype_wins(name, device, native, model, expected, reason):
    dtype, why = precision.choose_dtype(name, device, native, model)
    assert dtype == expected and reason in why


def test_float16_is_refused_whatever_the_hardware():
    for native in (None, "bfloat16"):
        with pytest.raises(UsageError, match="float16 would need loss scaling"):
            precision.choose_dtype("float16", "cuda", native, "org/model")


@pytest.mark.parametrize(
    "amx, avx512_bf16, onednn, expected",
    [
        (True, True, True, "AMX"),
        (False, True, True, "AVX-512 BF16"),
        (False, False, True, None),
        (True, True, False, None),
    ],
)
def test_the_cpu_is_asked_through_torch(monkeypatch, amx, avx512_bf16, onednn, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: onednn)
    probe = getattr(precision.native_bf16, "__wrapped__", precision.native_bf16)  # conftest pins the suite's CPUs
    assert probe(torch.device("cpu")) == expected


def test_the_choice_is_printed_with_its_reason(monkeypatch, capsys):
    monkeypatch.setattr(precision, "native_bf16", lambda device: "AVX-512 BF16")
    assert precision.resolve_dtype("auto", torch.device("cpu"), "org/model") == BF16
    assert "dtype: bfloat16 (auto: this CPU computes bfloat16 natively (AVX-512 BF16)" in capsys.readouterr().out
    assert precision.resolve_dtype("float32", torch.device("cpu"), "org/model") == F32
    assert "dtype: float32 (--dtype float32)" in capsys.readouterr().out


@pytest.mark.exact
def test_bfloat16_on_such_a_cpu_keeps_step_1_kl_at_0(monkeypatch, tmp_path, capsys):
    """On a CPU reported to have AVX-512 BF16, --dtype bfloat16 trains under bf16 autocast (a model other than the
    built-in tiny one: its weights, copied to a folder of another name), and the reference, held like the policy,
    logs a KL of exactly 0 at step 1."""
    from test_reproducibility import logged_scalars, only_run_dir

    from machinery import models

    monkeypatch.setattr(precision, "native_bf16", lambda device: "AVX-512 BF16")
    folder = str(tmp_path / "model")
    shutil.copytree(models.resolve_model_path(TINY_MODEL), folder)
    args = grpo.Args(
        model=folder,
        preset="tiny",
        num_steps=1,
        prompts_per_step=4,
        group_size=4,
        sample_every=0,
        dtype="bfloat16",
        output_dir=str(tmp_path / "runs"),
    )
    grpo.main(args)
    assert "dtype: bfloat16 (--dtype bfloat16)" in capsys.readouterr().out
    assert logged_scalars(only_run_dir(tmp_path / "runs"))["losses/kl_ref"] == [(1, 0.0)]
