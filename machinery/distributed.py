"""Running grpo.py and ppo.py on several processes under torchrun, with PyTorch's own FSDP2 and collectives.

    torchrun --nproc-per-node 8 grpo.py --model Qwen/Qwen2.5-7B-Instruct --task gsm8k      # one node, 8 GPUs

Every process runs the whole script on its share of each step: rank r takes the r-th slice of the same
global list of prompts (so a GRPO group never leaves its process), samples its completions with its own
seed, and holds a shard of every model (`fully_shard`: each decoder layer is a unit, the rest one more).
Whatever the algorithm normalises over the whole batch is summed or gathered over the processes here: the
loss denominators, GRPO's batch std, PPO's whitening and KL controller, the logged scalars. Each process's
loss is then its share of the whole batch's loss, so the gradients are summed over processes, not averaged.

A plain `python grpo.py` never starts a process group: every function here is then the identity or a no-op
(`dist` in the scripts is this file, not torch.distributed).

Generation (full_weights): the policy's whole weights are gathered once per rollout and kept through
generate(), then sharded again. That costs one all-gather of the model per step and its full float32
weights on every device meanwhile (4 bytes a parameter); decoding then needs no collective, so processes
whose completions end at different lengths never wait for each other. The alternative, FSDP's per-layer
gathering inside every forward, would save that memory but gather the whole model once per generated token.
"""

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time

import torch

from machinery.errors import UsageError, shorten

_device = torch.device("cpu")  # where collectives run: gloo on CPU tensors, nccl on this process's GPU


LAUNCH_SIZES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE")  # torchrun's counts of processes: at least 1
LAUNCH_INDICES = {"RANK": "WORLD_SIZE", "LOCAL_RANK": "LOCAL_WORLD_SIZE"}  # this process's place among them
MAX_PROCESSES = 1_000_000  # more than any launch holds; a count past it is a typo, not a cluster
PEER_WAIT_SECONDS = 600  # how long the processes wait for one another to join (a peer that never comes)


def check_environment(environ=os.environ):
    """torchrun's variables, checked like flags before anything reads them (startup.start calls this first): each
    count a whole number of at least 1, each rank one of its count's places, a node no larger than the launch,
    and several processes only with the MASTER_ADDR torchrun sets. One line for anything else."""
    values = {}
    for name in (*LAUNCH_SIZES, *LAUNCH_INDICES):
        text = environ.get(name)
        if text is None:
            continue
        if not re.fullmatch(r"[0-9]+", text.strip()):  # ASCII digits: str.isdigit also takes '²', which int refuses
            raise UsageError(
                f"{name} is {text[:40]!r}: torchrun sets it to a whole number (0, 1, 2, ...); unset it, or start "
                "with torchrun"
            )
        if len(text.strip()) > 7 or int(text) > MAX_PROCESSES:
            raise UsageError(
                f"{name} is {text.strip()[:40]}: more processes than a launch holds (at most {MAX_PROCESSES}); unset "
                "it, or start with torchrun"
            )
        values[name] = int(text)
    for name in LAUNCH_SIZES:
        if values.get(name, 1) < 1:
            raise UsageError(
                f"{name} is {values[name]}: a launch has at least 1 process; unset it, or start with torchrun"
            )
    for name, size in LAUNCH_INDICES.items():
        if size not in values and size == "LOCAL_WORLD_SIZE":  # a launcher other than torchrun may leave it unset
            size = "WORLD_SIZE"  # a node's processes are at most the launch's
        if name in values and values[name] >= values.get(size, 1):
            raise UsageError(
                f"{name} is {values[name]}, not below {size} {values.get(size, 1)}: unset it, or start with torchrun"
            )
    if values.get("LOCAL_WORLD_SIZE", 1) > values.get("WORLD_SIZE", 1):
        raise UsageError(
            f"LOCAL_WORLD_SIZE {values['LOCAL_WORLD_SIZE']} is more than WORLD_SIZE {values.get('WORLD_SIZE', 1)}, "
            "the processes of the whole launch: unset them, or start with torchrun"
        )
    if values.get("WORLD_SIZE", 1) > 1 and not environ.get("MASTER_ADDR"):
        raise UsageError(
            f"WORLD_SIZE is {values['WORLD_SIZE']} but MASTER_ADDR is not set, so the processes cannot meet: start "
            "the run with torchrun (docs/torchrun.md), or unset WORLD_SIZE"
        )
    if values.get("WORLD_SIZE", 1) > 1:
        check_master(environ["MASTER_ADDR"], environ.get("MASTER_PORT"))


def check_master(address, port):
    """MASTER_PORT a port (1 to 65535), MASTER_ADDR a host that resolves: else the processes retry until killed."""
    if port is None or not re.fullmatch(r"[0-9]{1,5}", port.strip()) or not 1 <= int(port) <= 65535:
        raise UsageError(
            f"MASTER_PORT is {shorten(port, 40)}: set it to a port number from 1 to 65535 (torchrun sets a free "
            "one), or start with torchrun"
        )
    try:
        socket.getaddrinfo(address, int(port))
    except (OSError, UnicodeError) as e:
        raise UsageError(
            f"MASTER_ADDR {address[:60]!r} cannot be resolved ({getattr(e, 'strerror', None) or e}): set it to the "
            "first node's address, or start with torchrun"
        ) from None


def initialized():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world_size():
    """Number of processes: torchrun's WORLD_SIZE (readable before the process group starts), else 1."""
    return torch.distributed.get_world_size() if initialized() else launch_number("WORLD_SIZE", 1)


def rank():
    if initialized():
        return torch.distributed.get_rank()
    return launch_number("RANK", 0) if launch_number("RANK", 0) < world_size() else 0  # else refused, as rank 0


def launch_number(name, default):
    """torchrun's variable `name` as a number; `default` where it is unset or no whole number (check_environment
    refuses that, in one line printed as the first process's)."""
    text = os.environ.get(name, "").strip()
    return int(text) if re.fullmatch(r"[0-9]{1,7}", text) else default


def is_main():
    """The process that prints, logs and writes files (rank 0)."""
    return rank() == 0


def check_launch(args, per_prompt, group_flag=None):
    """One line for a launch whose step cannot be shared out in whole prompts (with all their completions)."""
    n, prompts = world_size(), args.prompts_per_step
    if n == 1:
        return
    if args.dump_dir:
        raise UsageError(
            f"--dump-dir writes one process's batch, and this launch has {n}: dump with plain python (one process)"
        )
    if prompts < n:
        raise UsageError(
            f"--prompts-per-step {prompts} leaves some of the {n} processes without a prompt: "
            f"give each at least one (--prompts-per-step {n} or more, a multiple of {n})"
        )
    if prompts % n and group_flag and prompts * per_prompt % n == 0:
        raise UsageError(
            f"--prompts-per-step {prompts} on {n} processes would split a group ({group_flag} "
            f"{per_prompt}) across processes: make --prompts-per-step a multiple of {n}"
        )
    if prompts % n:
        raise UsageError(
            f"--prompts-per-step {prompts} ({prompts * per_prompt} completions) does not divide "
            f"across {n} processes: make it a multiple of {n}"
        )


def init(device):
    """Under torchrun: join the process group (nccl on GPU, one GPU per process; gloo on CPU) and return this
    process's device. Only rank 0 prints (the other processes' stdout is dropped). Otherwise: `device`."""
    global _device
    if world_size() == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not initialized():
        join_process_group("nccl" if device.type == "cuda" else "gloo")
    _device = device
    if not is_main() and sys.stdout is sys.__stdout__:
        sys.stdout = open(os.devnull, "w")
    return device


def shard(*models):
    """fully_shard each model (None passes through) over all processes: every decoder layer (the classes a
    transformers model lists in _no_split_modules) is its own unit, the rest of the model (embeddings, head,
    norms, PPO's value head) one more. Gradients are summed over the processes: each one's loss is already its
    share of the whole batch's loss. Every unit reshards after its forward (full_weights keeps them whole)."""
    if not initialized():
        return models if len(models) > 1 else models[0]
    from torch.distributed.fsdp import FSDPModule, fully_shard

    with _signals_to_main_thread():  # the first fully_shard may start the device mesh's process group
        for model in models:
            if model is None:
                continue
            layer_classes = {
                name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or []
            }
            for layer in [module for module in model.modules() if type(module).__name__ in layer_classes]:
                fully_shard(layer, reshard_after_forward=True)
            fully_shard(model, reshard_after_forward=True)
            for unit in model.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_gradient_divide_factor(1.0)
                    unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return models if len(models) > 1 else models[0]


def join_process_group(backend):
    """init_process_group, waiting for the other processes at most PEER_WAIT_SECONDS. It runs in a thread of its own
    (with the threads it starts, signals blocked: _signals_to_main_thread) while the main thread waits for it with
    signals open, so Ctrl-C or SIGTERM stop a wait for a peer that never comes; a wait past the bound is one line."""
    failed = []

    def join():
        try:
            torch.distributed.init_process_group(backend)
        except Exception as e:  # raised again in the main thread
            failed.append(e)

    with _signals_to_main_thread():  # the thread inherits the blocked signals; the main thread unblocks them after
        joining = threading.Thread(target=join, name="join_process_group", daemon=True)
        joining.start()
    deadline = time.monotonic() + PEER_WAIT_SECONDS
    while joining.is_alive():
        joining.join(0.1)
        if joining.is_alive() and time.monotonic() > deadline:
            raise UsageError(
                f"process {rank()} of {world_size()} waited {PEER_WAIT_SECONDS} s for the others at "
                f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}, and not all came: start every "
                "process (torchrun does), with the same MASTER_ADDR and MASTER_PORT"
            )
    if failed:
        raise failed[0]


@contextlib.contextmanager
def _signals_to_main_thread():
    """Threads started meanwhile (a process group's) never receive SIGINT/SIGTERM: a signal landing in gloo's I/O
    thread interrupts its wait and aborts the process. The main thread's handler (StopSignal) gets them instead."""
    signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


@contextlib.contextmanager
def full_weights(model):
    """The model's whole weights on every process meanwhile (generation, evaluation): gathered once, kept through
    every forward, then sharded again. See the top of this file for the cost."""
    if not initialized():
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)
        for unit in units:
            unit.reshard()


# ---------------------------------------------------------------------------------------------------
# Sums, means and gathers over the processes (the identity on one process).
# ---------------------------------------------------------------------------------------------------


def rows(n):
    """This process's rows of a batch gathered from all processes, n rows each."""
    return slice(rank() * n, (rank() + 1) * n)


def sum(x):  # noqa: A001 (as in torch.distributed's ReduceOp.SUM)
    """A number or tensor summed over the processes (a number comes back as a number)."""
    if not initialized():
        return x
    total = torch.as_tensor(x, dtype=torch.float64 if isinstance(x, float) else None).to(_device, copy=True)
    torch.distributed.all_reduce(total)
    return total.to(x.device) if torch.is_tensor(x) else total.item()


def any(flag):  # noqa: A001
    """Whether `flag` is true on at least one process."""
    return bool(sum(int(bool(flag))))


def gather(*tensors):
    """Each [n, ...] tensor (n the same on every process) gathered in rank order: [n x processes, ...]."""
    if initialized():
        gathered = []
        for x in tensors:
            parts = [torch.empty_like(x, device=_device) for _ in range(world_size())]
            torch.distributed.all_gather(parts, x.to(_device).contiguous())
            gathered.append(torch.cat(parts).to(x.device))
        tensors = tuple(gathered)
    return tensors if len(tensors) > 1 else tensors[0]


def masked_mean(x, mask):
    """common.masked_mean over the real positions of every process's batch: sum(x * m) / sum(m), each summed."""
    mask = mask.to(x.dtype)
    sums = sum(torch.stack([(x * mask).sum(), mask.sum()]))
    return sums[0] / sums[1].clamp(min=1)


def broadcast(value):
    """Rank 0's value (any picklable object) on every process."""
    if not initialized():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(value):
    """Every process's value (any picklable object), in rank order."""
    if not initialized():
        return [value]
    values = [None] * world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def barrier():
    if initialized():
        torch.distributed.barrier()


def finish():
    """Leave the process group once every process is done: a process that exits with it still open may abort in
    gloo's threads at interpreter shutdown ("terminate called without an active exception")."""
    if initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def local(tensor):
    """A replicated DTensor (a clipped gradient norm) as a plain tensor; anything else as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# ---------------------------------------------------------------------------------------------------
# Whole state for checkpoints: gathered from the shards, written by rank 0 in the one-process format.
# ---------------------------------------------------------------------------------------------------


def full_state_dict(model):
    """The model's whole state dict on rank 0 (CPU; empty elsewhere), for save_pretrained; None on one process."""
    if not initialized():
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first = {}  # tied weights (an LM head that is the embedding) come back as copies: one tensor again, as
    for name, param in model.named_parameters(remove_duplicate=False):  # save_pretrained expects to drop one
        if first.setdefault(id(param), name) != name and name in state_dict:
            state_dict[name] = state_dict[first[id(param)]]
    return state_dict


def load_state_dict(model, state_dict):
    """Load a whole (unsharded) state dict, as every process read it from a checkpoint, into the model's shards."""
    if not initialized():
        return model.load_state_dict(state_dict)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    return set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(optimizer):
    """optimizer.state_dict() with each sharded state tensor gathered whole, one at a time (kept on rank 0, CPU):
    the same keys and layout as on one process."""
    state_dict = optimizer.state_dict()
    if not initialized():
        return state_dict
    state = {
        index: {key: _whole(value) for key, value in param_state.items()}
        for index, param_state in state_dict["state"].items()
    }
    return dict(state_dict, state=state)


def _whole(value):
    if not hasattr(value, "full_tensor"):
        return value
    full = value.full_tensor()  # a collective: every process gathers, rank 0 keeps
    return full.cpu() if is_main() else None


def load_optimizer_state(optimizer, state_dict):
    """The counterpart of full_optimizer_state: load the whole state, then keep this process's shard of it."""
    optimizer.load_state_dict(state_dict)
    if not initialized():
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    for param, param_state in optimizer.state.items():
        for key, value in param_state.items():
            if isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape:
                param_state[key] = distribute_tensor(value, param.device_mesh, param.placements)
