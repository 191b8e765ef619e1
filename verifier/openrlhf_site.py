"""OpenRLHF's modules, loaded one by one from the folder it is installed in apart (for verifier/adapters/openrlhf.py).

Its package __init__ files import deepspeed, ray, vLLM and flash-attn; the modules the adapter calls are loaded one
by one instead, with `deepspeed` (imported, unused, by openrlhf.models.utils), ray, flash-attn
(openrlhf.models.ring_attn_utils, for packed samples only) and what the trainer files import for their engines
stubbed while they load. The names the trainer files import from packages whose __init__ files were not run are
set on those packages.
"""

import importlib
import os
import sys
import types

from verifier import peer_site

FLASH_ATTN = {  # what openrlhf.models.ring_attn_utils imports of flash-attn (for packed samples only)
    "flash_attn": (),
    "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils": (),
    "flash_attn.utils.distributed": ("all_gather",),
}
PACKAGES = [
    "openrlhf",
    "openrlhf.models",
    "openrlhf.utils",
    "openrlhf.trainer",
    "openrlhf.trainer.ppo_utils",
    "openrlhf.trainer.ray",
]
# What the actor's and critic's trainer files import for their engines (DeepSpeed, ray, vLLM, images), none of it
# used by training_step: empty while they load, with the names they import.
TRAINER_STUBS = {
    "openrlhf.utils.deepspeed": ("DeepspeedStrategy",),
    "openrlhf.utils.deepspeed.deepspeed_utils": ("offload_deepspeed_states", "reload_deepspeed_states"),
    "openrlhf.utils.distributed_util": ("stateless_init_process_group", "torch_dist_barrier_and_cuda_sync"),
    "openrlhf.utils.vlm_utils": ("merge_mm_train_inputs",),
    "openrlhf.trainer.ray.utils": ("get_physical_gpu_id",),
    "openrlhf.trainer.ray.launcher": ("RayActorGroup", "BaseModelActor"),
}


def load():
    """OpenRLHF's modules, from $OPENRLHF_SITE when set, else the first of sys.path or .openrlhf-site holding it."""
    root = peer_site.find(
        "openrlhf",
        os.path.join("models", "loss.py"),
        "pip install --no-deps --target .openrlhf-site -r requirements/openrlhf.txt",
    )
    for name in PACKAGES:  # namespace packages: their __init__ files (deepspeed, ray, vLLM) are not run
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(root, *name.split("."))]
            sys.modules[name] = package
    importlib.import_module("peft")  # before deepspeed is stubbed: transformers looks for it as peft loads
    with peer_site.stubbed(["deepspeed", "ray", *FLASH_ATTN, *TRAINER_STUBS]) as stubs:
        stubs["ray"].remote = lambda *a, **k: lambda cls: cls  # @ray.remote(num_gpus=1) on the engine classes
        for name, attributes in {**FLASH_ATTN, **TRAINER_STUBS}.items():
            for attribute in attributes:
                setattr(stubs[name], attribute, object)
        names = ("models.utils", "models.loss", "models.actor", "trainer.ppo_utils.experience_maker")
        modules = [importlib.import_module(f"openrlhf.{m}") for m in names]
        modules.append(importlib.import_module("openrlhf.trainer.ppo_utils.kl_controller"))
        # What the trainer files import from the packages whose __init__ files were not run
        package = sys.modules["openrlhf.models"]
        package.Actor, package.get_llm_for_sequence_regression = modules[2].Actor, None
        package.PolicyLoss, package.ValueLoss, package.aggregate_loss = (
            modules[1].PolicyLoss,
            modules[1].ValueLoss,
            modules[1].aggregate_loss,
        )
        sys.modules["openrlhf.utils"].get_tokenizer = None
        sys.modules["openrlhf.trainer.ppo_utils"].NaiveReplayBuffer = None
        for m in (
            "utils.loss_utils",
            "trainer.ppo_utils.experience",
            "trainer.ray.ppo_actor",
            "trainer.ray.ppo_critic",
        ):
            modules.append(importlib.import_module(f"openrlhf.{m}"))
    return modules
