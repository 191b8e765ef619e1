"""SkyRL 0.4.0 loaded for verifier/adapters/skyrl.py: its ppo_utils and torch_utils, its workers (workers.worker),
its model wrapper (workers.model_wrapper) and its trainer (train.trainer), each file run as it is, and the
stand-ins that let their methods run on one process: a `self` of the fields a method reads, a strategy whose
backward hands over the loss, the device (the CPU) and the metrics of rollout log-probs SkyRL's worker logs.

ppo_utils imports ray (its registries sync through a ray actor once ray is initialised: never here), jaxtyping
(annotations), loguru (warnings) and skyrl.train.config (AlgorithmConfig, an annotation; its module imports omegaconf
and skyrl_gym's environments): each is an empty stand-in while the module loads. The workers', wrapper's and
trainer's other imports (ray, their distributed strategies, flash-attn's padding helpers, peft, the dataset, the
inference engines) are stand-in classes that these methods never call. Nothing of SkyRL is copied here.
"""

import contextlib
import os
import sys
import types
import warnings

import torch

from verifier import peer_site

INSTALL = (
    "pip install --no-deps --target .skyrl-site --python-version 3.12 --only-binary=:all: --ignore-requires-python "
    "-r requirements/skyrl.txt"
)
UTILS = "skyrl.backends.skyrl_train.utils."
PACKAGES = ["skyrl", "skyrl.backends", "skyrl.backends.skyrl_train", "skyrl.backends.skyrl_train.utils"]
STUBS = ["ray", "jaxtyping", "loguru", "omegaconf", "skyrl.train", "skyrl.train.config"]
TOPS = ("skyrl", "ray", "loguru", "omegaconf", "jaxtyping", "flash_attn", "peft")


class _Annotation:
    """jaxtyping's Float / Integer: subscripted in annotations only."""

    def __class_getitem__(cls, item):
        return cls


def _utils(root):
    """SkyRL's ppo_utils and torch_utils; its package __init__ files (the tinker backend) are not run."""
    saved = {name: sys.modules.get(name) for name in PACKAGES}
    for name in PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = package
    names = [UTILS + m for m in ("ppo_utils", "torch_utils", "off_policy_correction_utils")]
    try:
        with peer_site.stubbed(STUBS) as stubs:
            stubs["ray"].remote = lambda cls: cls  # RegistryActor: a class ray would host, never started
            stubs["ray"].is_initialized = lambda: False
            stubs["jaxtyping"].Float = stubs["jaxtyping"].Integer = _Annotation
            stubs["loguru"].logger = types.SimpleNamespace(info=print, warning=print, error=print)
            stubs["omegaconf"].DictConfig = object
            stubs["skyrl.train.config"].AlgorithmConfig = object
            ppo_utils = __import__(names[0], fromlist=["*"])
            torch_utils = sys.modules[names[1]]
    finally:  # SkyRL's modules stay loaded under this adapter's names; sys.modules is as it was
        for name in names:
            sys.modules.pop(name, None)
        peer_site.restore(saved)
    ppo_utils.repopulate_all_registries()
    return ppo_utils, torch_utils


def load():
    """(ppo_utils, torch_utils, worker, model_wrapper, trainer), from $SKYRL_SITE when set, else sys.path or
    .skyrl-site."""
    root = peer_site.find("skyrl", os.path.join("backends", "skyrl_train", "utils", "ppo_utils.py"), INSTALL)
    ppo_utils, torch_utils = _utils(root)
    real = {UTILS + "ppo_utils": ppo_utils, UTILS + "torch_utils": torch_utils}
    files = ["backends/skyrl_train/workers/worker.py", "backends/skyrl_train/workers/model_wrapper.py"]
    files.append("train/trainer.py")
    loaded = [
        peer_site.load_file(os.path.join(root, "skyrl", f), f"skyrl_{i}", real, TOPS) for i, f in enumerate(files)
    ]
    loaded[0].compute_minibatch_rollout_logprob_diff_metrics = lambda *args: {}  # metrics of rollout log-probs: none
    return (ppo_utils, torch_utils, *loaded)


ppo_utils, torch_utils, worker, model_wrapper, trainer = load()


@contextlib.contextmanager
def _on_cpu():
    """The worker moves its micro-batch to torch.cuda.current_device(): here the CPU, where nothing moves; its CUDA
    autocast is off on the CPU (torch's warning that says so is not repeated to the user)."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
            yield
    finally:
        torch.cuda.current_device = saved


def wrapped(model):
    """HFModelWrapper around the policy as its __init__ leaves it for a model passed in (sdpa attention, no
    padding removal, no sequence parallelism, the chunked entropy uncompiled), without loading one."""
    wrapper = model_wrapper.HFModelWrapper.__new__(model_wrapper.HFModelWrapper)
    torch.nn.Module.__init__(wrapper)
    wrapper.model, wrapper.temperature, wrapper.is_vlm = model, 1.0, False
    wrapper.sequence_parallel_size, wrapper.remove_microbatch_padding = 1, False
    wrapper.attn_implementation, wrapper.logprobs_chunk_size = "sdpa", 1024
    wrapper.chunked_entropy_from_logits_fn = torch_utils.chunked_entropy_from_logits
    return wrapper


class critic_model:
    """SkyRL's CriticModel.forward (model_wrapper._get_critic_model) on this project's critic's transformer and head
    (value_head_prefix "value_head"): its position ids, its head, its shift."""

    def __init__(self, critic):
        self.forward = model_wrapper._get_critic_model(torch.nn.Module, torch.nn.Module, "value_head").forward
        self.me = types.SimpleNamespace(
            base_model_prefix="backbone",
            value_head_prefix="value_head",
            backbone=critic.backbone,
            value_head=critic.value_head,
            remove_microbatch_padding=False,
            sequence_parallel_size=1,
        )

    def train(self):
        pass

    def __call__(self, *args, **kwargs):
        return self.forward(self.me, *args, **kwargs)


class Stored:
    """A model whose forward returns what the dump stored (the loss rows read the model's outputs from it)."""

    def __init__(self, *output):
        self.output = output

    def train(self):
        pass

    def __call__(self, *args, **kwargs):
        return self.output


def backpropagated(method, model, config, experience, weight, **fields):
    """The loss `method` (a worker's _forward_backward_micro) hands its strategy's backward, for one process."""
    captured = []
    me = types.SimpleNamespace(
        model=model,
        cfg=types.SimpleNamespace(algorithm=config),
        strategy=types.SimpleNamespace(backward=lambda loss, model, optimizer: captured.append(loss)),
        mesh_rank=types.SimpleNamespace(dp_size=1),
        scheduler=types.SimpleNamespace(get_last_lr=lambda: [0.0]),
        optimizer=None,
        **fields,
    )
    with _on_cpu():
        method(me, experience, microbatch_weight=weight)
    return captured[0]


class Batch(dict):
    """The trainer's TrainingInputBatch as its methods read it: tensors by name, rows by a slice, a metadata dict."""

    metadata = None

    def __getitem__(self, key):
        if isinstance(key, slice):
            return Batch({name: value[key] for name, value in self.items()})
        return dict.__getitem__(self, key)


def normalized_advantages(advantages, loss_mask, config, micro_batch_size):
    """The trainer's _normalize_advantages on one minibatch (no advantage_batch_normalize, SkyRL's default): its
    apply_loss_reduction_to_advantages_minibatch with the trainer's arguments."""
    algorithm = types.SimpleNamespace(
        advantage_batch_normalize=False, loss_reduction=config.loss_reduction, max_seq_len=config.max_seq_len
    )
    me = types.SimpleNamespace(
        cfg=types.SimpleNamespace(
            trainer=types.SimpleNamespace(algorithm=algorithm, micro_train_batch_size_per_gpu=micro_batch_size)
        )
    )
    data = Batch(advantages=advantages, loss_mask=loss_mask, response_mask=loss_mask)
    return trainer.RayPPOTrainer._normalize_advantages(me, data, [(0, len(advantages))], None)["advantages"]


def reward_kl_penalty(batch, args, rewards):
    """The trainer's apply_reward_kl_penalty on the batch, with its AdaptiveKLController (a fixed coefficient when
    the dump has no --target-kl): (the penalised rewards, the controller's next coefficient)."""
    coef = batch["kl_coef"].item()
    if args["target_kl"] is None:
        controller = ppo_utils.FixedKLController(coef)
    else:
        controller = ppo_utils.AdaptiveKLController(coef, args["target_kl"], args["kl_horizon"])
    algorithm = types.SimpleNamespace(kl_estimator_type=args["kl_estimator"], kl_loss_coef=coef)
    me = types.SimpleNamespace(
        cfg=types.SimpleNamespace(trainer=types.SimpleNamespace(algorithm=algorithm)),
        reward_kl_controller=controller,
        all_metrics={},
    )
    data = Batch(
        loss_mask=batch["completion_mask"],
        rewards=rewards,
        base_action_log_probs=batch["ref_logp"],
        action_log_probs=batch["old_logp"],
    )
    data.metadata = {}
    out = trainer.RayPPOTrainer.apply_reward_kl_penalty(me, data)
    return out["rewards"], controller.value
