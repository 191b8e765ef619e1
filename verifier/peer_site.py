"""A peer installed apart (`pip install --no-deps --target .PEER-site`): finding its folder, and empty stand-ins
for the modules its files import and never call while they load (verifier/adapters/skyrl.py,
verifier/adapters/areal.py and verifier/openrlhf_site.py)."""

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find(package, marker, install):
    """The folder that holds `marker` (a file of the peer's, under `package`/): $PACKAGE_SITE when set, else the
    first of sys.path or the checkout's .package-site; an ImportError naming `install` (the pip command) if none."""
    variable, checkout = f"{package.upper()}_SITE", os.path.join(ROOT, f".{package}-site")
    chosen = os.environ.get(variable)
    candidates = [chosen] if chosen else [*sys.path, checkout]
    root = next((p for p in candidates if p and os.path.isfile(os.path.join(p, package, marker))), None)
    if root is None:
        raise ImportError(f"no {package} in {chosen if chosen else f'PYTHONPATH or {checkout}'}: {install}")
    return root


def restore(saved):
    """sys.modules as `saved` ({name: the module, or None where there was none}) had it."""
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


@contextlib.contextmanager
def stubbed(names, fill=None):
    """Empty modules for `names` (each given to `fill` first, when given) while the peer's files load, then
    sys.modules as it was for them. Yields the modules by name."""
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
        if fill is not None:
            fill(sys.modules[name])
    try:
        yield {name: sys.modules[name] for name in names}
    finally:
        restore(saved)


class _Meta(type):
    """A stand-in class: any attribute is another stand-in class, used as a decorator it returns what it decorates,
    subscripted (an annotation) it is itself."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return stand_in_class(name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return type.__call__(cls)

    def __getitem__(cls, item):
        return cls


def _called(self, *args, **kwargs):
    """A stand-in's instance called: a decorator made by a factory returns what it decorates."""
    return args[0] if len(args) == 1 and not kwargs and callable(args[0]) else self


def stand_in_class(name):
    return _Meta(name, (), {"__getattr__": lambda self, attribute: stand_in_class(attribute), "__call__": _called})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return stand_in_class(name)


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-in modules for the packages named: every name imported from them is a stand-in class."""

    def __init__(self, tops):
        self.tops = tops

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.tops:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def load_file(path, name, real, tops):
    """The peer's file at `path`, run as module `name` with the modules `real` ({name: module}) for what it imports
    of them and stand-ins for the rest of the packages `tops` (what it imports and never calls here); those are as
    they were in sys.modules afterwards. The file's functions keep what they imported."""
    saved, finder = dict(sys.modules), _StandIns(tops)
    sys.meta_path.insert(0, finder)
    try:
        for loaded in [n for n in sys.modules if n.split(".")[0] in tops]:
            sys.modules.pop(loaded)
        sys.modules.update(real)
        spec = importlib.util.spec_from_file_location(name, path)
        module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(module)
    finally:  # the peer's and the stand-in modules go; what else the file imported (torch's, say) stays, as imports do
        sys.meta_path.remove(finder)
        for loaded in [n for n in sys.modules if n.split(".")[0] in tops or n == name or n in real]:
            if loaded in saved:
                sys.modules[loaded] = saved[loaded]
            else:
                del sys.modules[loaded]
    return module


def fresh(name):
    """The module `name` (verifier.skyrl_site, verifier.areal_site) run anew, not taken from sys.modules: each load
    of an adapter finds its peer again, where $PEER_SITE now points."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
