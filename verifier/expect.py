"""Helpers for an adapter's known differences (verify.py's docstring): an expectation is computed from the dump,
independently of the peer, by this project's own entry points with the one change the peer makes by design.

    from verifier.expect import ours, with_args
    expect=with_args(ours().group_advantages, adv_eps=1e-6)      # the peer divides by std + 1e-6
"""

import functools
import importlib.util
import os

import torch

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "adapters", "self.py")


@functools.lru_cache(maxsize=1)
def ours():
    """This project's adapter (verifier/adapters/self.py): the functions every expectation starts from."""
    spec = importlib.util.spec_from_file_location("verify_expect_self", HERE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_args(fn, **changes):
    """fn(*inputs, args) called with the run's args changed by `changes` (a flag the peer sets otherwise)."""

    def expect(*given):
        *rest, args = given
        return fn(*rest, dict(args, **changes))

    return expect


def unbiased_whiten(x, mask, eps):
    """(x - mean) / sqrt(var * n / (n - 1) + eps) over the real positions (n of them), 0 elsewhere: a whitening
    with the unbiased variance, as torch's std() and several peers take it."""
    real = mask.bool()
    n = real.sum()
    mean = x[real].mean()
    var = ((x - mean)[real] ** 2).sum() / (n - 1).clamp(min=1)
    return torch.where(real, (x - mean) * torch.rsqrt(var + eps), torch.zeros_like(x))


def floored_whiten(x, mask, floor):
    """(x - mean) * rsqrt(max(var, floor)) over the real positions (the population variance), 0 elsewhere: a
    whitening whose variance is floored, not shifted by an eps."""
    real = mask.bool()
    mean = x[real].mean()
    var = ((x - mean)[real] ** 2).mean()
    return torch.where(real, (x - mean) * torch.rsqrt(var.clamp(min=floor)), torch.zeros_like(x))
