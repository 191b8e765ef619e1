"""AReaL 1.0.4 loaded for verifier/adapters/areal.py: its actor (areal.trainer.ppo.actor), critic
(areal.trainer.ppo.critic), data and functional modules and its FSDP engine (areal.engine.fsdp_engine), each file run
as it is, and the stand-in
`self` of the engine's methods for one process (no FSDP wrapping, no process groups, no packing).

AReaL's package __init__ files import its inference and training engines; the modules are loaded one by one instead.
Stand-ins, while they load, for what they import and these calls never use: areal.api and areal.api.cli_args (engine
and config classes, annotations), areal.infra and the experimental controller (the controller classes the actor's
module defines beside PPOActor), areal.utils.logging (colorlog), stats_tracker and perf_tracer (logging of statistics:
no-ops), seqpack (numba), einops and torchdata (imported by areal.utils.data for its other functions); the engine's and
the critic's other imports are stand-in classes these calls never call. areal.infra.platforms says
is_npu_available, so areal's vocab_parallel module gathers eagerly rather than under torch.compile (its NPU path: the
same function, uncompiled). Nothing of AReaL is copied here.
"""

import contextlib
import os
import sys
import types

import torch

from verifier import peer_site

PACKAGES = ["areal", "areal.utils", "areal.utils.functional", "areal.trainer", "areal.trainer.ppo"]
STUBS = [
    "areal.api",
    "areal.api.cli_args",
    "areal.infra",
    "areal.infra.platforms",
    "areal.infra.rpc",
    "areal.infra.rpc.serialization",
    "areal.experimental",
    "areal.experimental.training_service",
    "areal.experimental.training_service.controller",
    "areal.experimental.training_service.controller.controller",
    "areal.utils.logging",
    "areal.utils.stats_tracker",
    "areal.utils.perf_tracer",
    "areal.utils.seqpack",
    "einops",
    "torchdata",
    "torchdata.stateful_dataloader",
]


def _nothing(*args, **kwargs):
    """A logging call of AReaL's (stats_tracker): it records statistics, never the loss."""


def _identity_decorator(*args, **kwargs):
    return lambda fn: fn


@contextlib.contextmanager
def _scope(*args, **kwargs):
    yield


def _stub(module):
    """What each stand-in offers: names that are annotations, base classes or logging."""
    name = module.__name__
    if name == "areal.utils.logging":
        module.getLogger = lambda *a, **k: types.SimpleNamespace(info=_nothing, warning=_nothing, debug=_nothing)
    elif name == "areal.utils.stats_tracker":
        module.__getattr__ = lambda attribute: _nothing
        module.scope_func_wrapper, module.scope = _identity_decorator, _scope
    elif name == "areal.utils.perf_tracer":
        module.trace_perf = _identity_decorator
    elif name == "areal.infra.platforms":
        # True: vocab_parallel.py's log-prob gather runs eagerly, not under torch.compile (a speed choice only)
        module.current_platform, module.is_npu_available = None, True
    else:  # classes and helpers imported by name and never called here
        module.__getattr__ = lambda attribute: type(attribute, (), {})


def _load():
    """AReaL's actor and functional modules, from $AREAL_SITE when set, else sys.path or .areal-site."""
    root = peer_site.find(
        "areal",
        os.path.join("trainer", "ppo", "actor.py"),
        "pip install --no-deps --target .areal-site -r requirements/areal.txt",
    )
    before = set(sys.modules)
    saved = {name: sys.modules.get(name) for name in PACKAGES}
    for name in PACKAGES:  # namespace packages: their __init__ files (engines, vLLM, ray) are not run
        package = types.ModuleType(name)
        package.__path__ = [os.path.join(root, *name.split("."))]
        sys.modules[name] = package
    try:
        with peer_site.stubbed(STUBS, fill=_stub):
            functional = __import__("areal.utils.functional.functional", fromlist=["*"])
            sys.modules["areal.utils.functional"].__dict__.update(
                {k: v for k, v in vars(functional).items() if not k.startswith("__")}
            )  # what the package's __init__ re-exports (its vocab_parallel import needs the platforms)
            actor = __import__("areal.trainer.ppo.actor", fromlist=["*"])
            data = sys.modules["areal.utils.data"]
            vocab = __import__("areal.utils.functional.vocab_parallel", fromlist=["*"])
    finally:  # AReaL's modules stay loaded under this adapter's names; sys.modules is as it was
        for name in set(sys.modules) - before:
            if name.startswith("areal"):
                sys.modules.pop(name, None)
        peer_site.restore(saved)
    package = types.ModuleType("areal.utils.functional")  # what the package's __init__ re-exports
    package.__dict__.update({k: v for k, v in vars(functional).items() if not k.startswith("__")})
    package.gather_logprobs, package.gather_logprobs_entropy = vocab.gather_logprobs, vocab.gather_logprobs_entropy
    real = {"areal.utils.functional": package, "areal.utils.data": data}
    real["areal.utils.functional.functional"], real["areal.utils.functional.vocab_parallel"] = functional, vocab
    engine, critic = [
        peer_site.load_file(os.path.join(root, "areal", f), f"areal_{i}", real, ("areal", "torchdata"))
        for i, f in enumerate(["engine/fsdp_engine.py", "trainer/ppo/critic.py"])
    ]
    return actor, critic, functional, data, engine


actor, critic, functional, data, engine = _load()


def engine_self(args, is_critic=False):
    """The FSDPEngine's `self` as _compute_logprobs_and_loss reads it on one process: its config's temperature and
    role, no tree training, tensor, sequence and data parallel sizes of 1."""
    me = types.SimpleNamespace(
        config=types.SimpleNamespace(temperature=args["temperature"], is_critic=is_critic),
        enable_tree_training=False,
        parallel_helper=types.SimpleNamespace(tp_size=1, sp_size=1, dp_size=1, tp_group=None),
    )
    for name in ("_compute_logprobs_entropy", "_compute_logprobs", "_get_vocab_min_max_logits", "_compute_values"):
        setattr(me, name, types.MethodType(getattr(engine.FSDPEngine, name), me))
    return me


def engine_loss(args, output, input_ids, mb_input, loss_fn, total_weight, is_critic=False):
    """FSDPEngine._compute_logprobs_and_loss on a micro-batch: its log-probs and entropy (gather_logprobs_entropy
    at the engine's temperature) or values, `loss_fn`, scaled by the micro-batch's loss weight (its tokens) over
    the minibatch's `total_weight` (compute_total_loss_weight's sum)."""
    context = engine.FSDPTrainContext(model_inputs=dict(input_ids=input_ids), mb_input=mb_input)
    weight = torch.tensor(float(total_weight))
    return engine.FSDPEngine._compute_logprobs_and_loss(
        engine_self(args, is_critic), output, context, loss_fn, WEIGHTS[is_critic], weight
    )


def loss_weight_fn(method):
    """The loss_weight_fn a PPOActor's or PPOCritic's _ppo_update passes to engine.train_batch: the lambda written
    in that method (x["loss_mask"].count_nonzero()), taken from its code as it is."""
    lambdas = [c for c in method.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "<lambda>"]
    assert len(lambdas) == 1, f"{method.__qualname__}: one loss_weight_fn lambda expected, found {len(lambdas)}"
    return types.FunctionType(lambdas[0], method.__globals__)


WEIGHTS = {False: loss_weight_fn(actor.PPOActor._ppo_update), True: loss_weight_fn(critic.PPOCritic._ppo_update)}
