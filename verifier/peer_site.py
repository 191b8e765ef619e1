"""A peer installed apart (`pip install --no-deps --target .PEER-site`): finding its folder, and empty stand-ins
for the modules its files import and never call while they load (verifier/adapters/skyrl.py,
verifier/adapters/areal.py and verifier/openrlhf_site.py)."""

import contextlib
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
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
