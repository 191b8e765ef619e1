"""verify.py's calls of an adapter: loading it, its options and declared differences, and calling its functions so
that any mistake in them is one line (exit status 3); this project's own adapter failing on a dump is bad input.
"""

import glob
import importlib.util
import math
import os

import torch

from verifier.report import CEILING, QUANTITIES, AdapterError, Interrupted, VerifyError, one_line

ROOT = os.path.dirname(os.path.abspath(__file__))
SELF = os.path.join(ROOT, "adapters", "self.py")
FUNCTIONS = [
    "group_advantages",
    "gae",
    "rewards",
    "kl_coef",
    "token_logprobs",
    "kl",
    "per_token_loss",
    "loss",
    "train_loss",
    "update",
]
# Set by verify.py's isolation (isolation.py) to tell its parent which adapter call is running, or None between.
watch = None


def mark(what):
    if watch is not None:
        watch(what)


def load_adapter(name):
    """A shipped adapter (adapters/NAME.py) or a path to a .py file."""
    path = name if name.endswith(".py") or os.sep in name else os.path.join(ROOT, "adapters", f"{name}.py")
    if not os.path.isfile(path):
        shipped = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "adapters", "*.py")))
        raise VerifyError(f"no adapter {name!r}: pass one of {', '.join(shipped)} or the path of a .py file")
    label = os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(f"verify_adapter_{label}", path)
    module = importlib.util.module_from_spec(spec)
    mark(f"importing adapter {label!r}")
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise VerifyError(f"adapter {label!r} cannot be imported: {one_line(e)}") from None
    except SyntaxError as e:
        raise AdapterError(f"adapter {label!r} does not compile: {e.filename}:{e.lineno}: {e.msg}") from None
    except KeyboardInterrupt:
        raise Interrupted(f"while importing adapter {label!r}") from None
    except SystemExit as e:
        raise AdapterError(f"adapter {label!r} called sys.exit({e.code!r}) on import") from None
    except Exception as e:
        raise AdapterError(f"adapter {label!r} raised {type(e).__name__} on import: {one_line(e)}") from None
    mark(None)
    if not any(callable(getattr(module, f, None)) for f in FUNCTIONS):
        raise VerifyError(f"adapter {label!r} ({path}) defines none of the functions {', '.join(FUNCTIONS)}")
    module.label, module._verify_self = label, os.path.abspath(path) == SELF
    return module


def parse_options(adapter, pairs):
    """--set name=value pairs, checked against the adapter's OPTIONS and typed like their defaults."""
    declared = getattr(adapter, "OPTIONS", {})
    if not isinstance(declared, dict) or not all(
        isinstance(k, str) and type(v) in (bool, int, float, str) for k, v in declared.items()
    ):
        raise AdapterError(
            f"adapter {adapter.label!r}: OPTIONS is {type(declared).__name__} {str(declared)[:60]}: make it a dict "
            "{name: default}, each default a bool, int, float or str"
        )
    options = dict(declared)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in options:
            known = f"(options: {', '.join(options) or 'none'})"
            raise VerifyError(f"--set {pair!r}: adapter {adapter.label!r} has no option {key!r} {known}")
        kind = type(options[key])
        if kind is bool:
            if value.lower() not in ("true", "false"):
                raise VerifyError(f"--set {pair!r}: {key} takes true or false")
            options[key] = value.lower() == "true"
            continue
        try:
            options[key] = kind(value)
        except (TypeError, ValueError):
            raise VerifyError(f"--set {pair!r}: {key} takes a {kind.__name__}, like its default {options[key]!r}")
        if kind is float and not math.isfinite(options[key]):
            raise VerifyError(f"--set {pair!r}: {key} must be a finite number")
    return options


def known_differences(adapter, args, options):
    """The adapter's declared known differences, checked: {quantity: dict(why, where, expect=FUNCTION)} (the value
    its peer gives by design, compared at the row's tolerance), or, where no exact expectation exists,
    {quantity: dict(why, where, bound=(kind, value), derivation=TEXT)}."""
    if not hasattr(adapter, "known_differences"):
        return {}
    declared, _ = call(adapter, "known_differences", args, options)
    example = "dict(why='...', where='file.py, function', expect=FUNCTION)"
    if not isinstance(declared, dict):
        raise AdapterError(f"adapter {adapter.label!r}: known_differences() returned {type(declared).__name__}")
    for quantity, spec in declared.items():
        try:
            problem = known_problem(quantity, spec)
        except Exception as e:  # a value no check foresaw: the adapter's mistake all the same
            problem = f"cannot be read ({type(e).__name__}: {one_line(e)})"
        if problem:
            raise AdapterError(
                f"adapter {adapter.label!r}: known_differences()[{str(quantity)[:40]!r}] {problem}: declare each as "
                f"{example}, keyed by one of {', '.join(QUANTITIES)}"
            )
    return declared


def known_problem(quantity, spec):
    """What is wrong with one declared known difference, or None. A bound is a finite number >= 0, and a relative
    one at most CEILING: a difference larger than the row's own values is another quantity, not a difference."""
    if quantity not in QUANTITIES:
        return "is keyed by no row of the table"
    if not isinstance(spec, dict) or not all(isinstance(spec.get(k), str) and spec[k] for k in ("why", "where")):
        return f"is {str(spec)[:80]}, without a why and a where (text)"
    if "expect" in spec:
        return None if callable(spec["expect"]) else f"has expect={str(spec['expect'])[:40]}, not a function"
    if not (isinstance(spec.get("derivation"), str) and spec["derivation"].strip()):
        return "has a bound without a derivation (text: why the difference cannot exceed it), or no expect"
    bound = spec.get("bound")
    if not (isinstance(bound, (tuple, list)) and len(bound) == 2 and bound[0] in ("abs", "rel")):
        return f"has the bound {str(bound)[:40]}, not (kind, value) with kind 'abs' or 'rel'"
    value = bound[1]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not (0 <= value < math.inf) or (isinstance(value, int) and value.bit_length() > 1000):
        return f"has the bound value {str(value)[:40]}, not a finite number >= 0"
    if bound[0] == "rel" and value > CEILING:
        return f"has the bound rel {value:.3g}, beyond the ceiling rel {CEILING:g} (the row's own size): implausible"
    return None


def call(adapter, name, *args):
    """The adapter's function's result and None, or None and why it is skipped (no such function, or it raised
    NotImplementedError(reason)). Anything else it does wrong is an AdapterError naming it; this project's own
    adapter failing is a VerifyError: the dump cannot be recomputed."""
    fn = getattr(adapter, name, None)
    if fn is None:
        return None, f"adapter has no {name}()"
    # Copies of the batch's tensors and of the run's args: an adapter that writes into them cannot change later
    # checks (update()'s state, the one other dict, is the adapter's to keep).
    args = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in a.items()}
        if isinstance(a, dict) and ("completion_mask" in a or "script" in a)
        else a
        for a in args
    ]
    mark(f"{name}() of adapter {adapter.label!r}")
    try:
        out = fn(*args)
    except NotImplementedError as e:
        return None, str(e) or f"{name}() is not implemented for this run"
    except KeyboardInterrupt:
        raise Interrupted(f"in {name}() of adapter {adapter.label!r}") from None
    except SystemExit as e:
        raise AdapterError(f"adapter {adapter.label!r}: {name}() called sys.exit({e.code!r})") from None
    except Exception as e:
        if getattr(adapter, "_verify_self", False):
            raise VerifyError(
                f"this project's {name}() cannot recompute the dump ({type(e).__name__}: {one_line(e)}): the dump "
                "is damaged or of another version; make it again"
            ) from None
        raise AdapterError(f"adapter {adapter.label!r}: {name}() raised {type(e).__name__}: {one_line(e)}") from None
    finally:
        mark(None)
    if out is None and name not in ("update", "setup"):
        raise AdapterError(
            f"adapter {adapter.label!r}: {name}() returned None: return its value, or raise "
            "NotImplementedError(reason) to skip the check"
        )
    return out, None


def as_tensor(adapter, name, value):
    try:
        tensor = torch.as_tensor(value.detach() if torch.is_tensor(value) else value)
    except Exception:
        raise AdapterError(
            f"adapter {adapter.label!r}: {name}() returned {type(value).__name__}, not a tensor"
        ) from None
    if tensor.is_complex():  # .float() would drop the imaginary part without a word
        raise AdapterError(
            f"adapter {adapter.label!r}: {name}() returned complex values ({tensor.dtype}): return reals"
        )
    try:
        return tensor.float().cpu()
    except Exception as e:  # a tensor with no values to read (the meta device), or of a dtype with no float
        raise AdapterError(
            f"adapter {adapter.label!r}: {name}() returned a tensor that cannot be read as float32 on the CPU "
            f"({type(e).__name__}: {one_line(e)})"
        ) from None


def expecting(report, quantity):
    """The accepted known difference's expect function of this row, or None."""
    spec = report.rows[quantity]["known"]
    return spec["expect"] if spec and "expect" in spec else None


def expectation(report, quantity, adapter, *given):
    """The accepted known difference's expectation on `given` (the inputs of the adapter's function), or None. Its
    mistakes are the adapter's (exit status 3)."""
    fn = expecting(report, quantity)
    if fn is None:
        return None
    name = f"known_differences()[{quantity!r}]['expect']"
    out, _ = call(type("Expectation", (), {"label": adapter.label, name: staticmethod(fn)}), name, *given)
    return out


def compare(report, quantity, step, adapter, fn, value, expected, mask=None, what="", scale=None, known=None):
    """The adapter's `value` (from `fn`) against the dump's `expected`, which must have the same shape; `known`:
    the accepted known difference's expectation (expectation()), of the same shape."""
    if value is None:
        return
    if expected is None:
        return report.skip(quantity, f"the dump has no {what}")
    actual = as_tensor(adapter, fn, value)
    if actual.shape != expected.shape:
        raise AdapterError(
            f"adapter {adapter.label!r}: {fn}() returned shape {tuple(actual.shape)} at step {step}; "
            f"the dump's {what} is {tuple(expected.shape)}"
        )
    if known is not None:
        known = as_tensor(adapter, "the known difference's expect", known)
        if known.shape != actual.shape and known.shape == actual.shape[:1]:  # one value a row, for every token
            known = known[:, None].expand_as(actual)
        if known.shape != actual.shape:
            raise AdapterError(
                f"adapter {adapter.label!r}: the known difference's expect for {quantity} returned shape "
                f"{tuple(known.shape)} at step {step}; {fn}() returned {tuple(actual.shape)}"
            )
    report.add(quantity, step, actual, expected, mask, what, scale, known)


def written_out(adapter, args, options):
    """The pieces of its peer the adapter writes out itself (not compared): WRITTEN_OUT, a list of lines, or
    written_out(args, options) returning one. Every PASS line names them."""
    if hasattr(adapter, "written_out"):
        lines, _ = call(adapter, "written_out", args, options)
    else:
        lines = getattr(adapter, "WRITTEN_OUT", [])
    if not isinstance(lines, (list, tuple)) or not all(isinstance(line, str) for line in lines):
        raise AdapterError(f"adapter {adapter.label!r}: WRITTEN_OUT / written_out() must be a list of lines (str)")
    return list(lines)
