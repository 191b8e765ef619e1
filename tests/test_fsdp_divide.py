"""The gradient reduction FSDP is given: a sum over the processes (divide factor 1), since each process's loss
is already its share of the whole batch's. In one process (gloo, world size 1), where a sum and a mean are
the same number, so the factor itself is read; test_distributed.py's slow runs check the sums of two."""

import socket

import torch
from conftest import make_small_model

from machinery import distributed as dist


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_fsdp_unit_sums_its_gradients():
    from torch.distributed.fsdp import FSDPModule

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        policy, critic = dist.shard(make_small_model("qwen2"), make_small_model("qwen2", seed=1))
        for model in (policy, critic):
            groups = [
                g
                for unit in model.modules()
                if isinstance(unit, FSDPModule)
                for g in unit._get_fsdp_state()._fsdp_param_groups
            ]
            assert len(groups) == 3  # each of the 2 decoder layers and the rest of the model
            assert all(g.gradient_divide_factor == 1.0 and g.force_sum_reduction_for_comms for g in groups)
    finally:
        torch.distributed.destroy_process_group()
