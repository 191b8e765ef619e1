"""The format of a checkpoint's state (checkpoints.py): one file, state.safetensors, whose tensors are the state's
tensors and whose metadata holds everything else as JSON. Reading it runs no code, whoever wrote the file: a
crafted checkpoint can hold wrong numbers, which the checks of checkpoints.load_checkpoint refuse, never a program
(a pickle, as torch.save writes, can: docs/bad_input.md's threat model).

What the state may hold: tensors, numpy arrays of numbers, None, bools, ints, floats, strings, and lists, tuples
and dicts of these (dict keys: strings, ints or tuples). Tuples come back as tuples and int keys as ints, so the
Python and numpy RNG states, an optimizer's state_dict and a fork's setup-time tensors round-trip exactly.
Also here: what a checkpoint records to check it later (the files' digests, the training data's fingerprint).
"""

import hashlib
import json
import os
import random

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from machinery.errors import UsageError

STATE = "state.safetensors"  # beside the models' folders in a checkpoint
OLD_STATE = "state.pt"  # what versions before format 3 wrote: a pickle, never opened (it could run code)
TAGS = ("__tensor__", "__tuple__", "__items__", "__ndarray__")  # a one-key object with one of these is a tag
MAX_DEPTH = 64  # a state nests a few levels deep; deeper is not ours (and Python's recursion stops near 1000)


def _encode(value, tensors, depth=0):
    """`value` as JSON, its tensors moved into `tensors` (named by their order) and replaced by a tag."""
    if depth > MAX_DEPTH:
        raise TypeError(f"the state nests deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = value.detach().cpu().contiguous().clone()  # safetensors refuses tensors that share memory
        return {"__tensor__": name}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return {"__ndarray__": [value.dtype.str, list(value.shape), value.ravel().tolist()]}
    if isinstance(value, np.generic):  # a numpy scalar: its Python number
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(item, tensors, depth + 1) for item in value]}
    if isinstance(value, list):
        return [_encode(item, tensors, depth + 1) for item in value]
    if isinstance(value, dict):
        if all(type(key) is str for key in value) and not (len(value) == 1 and next(iter(value)) in TAGS):
            return {key: _encode(item, tensors, depth + 1) for key, item in value.items()}
        pairs = value.items()
        return {"__items__": [[_encode(k, tensors, depth + 1), _encode(v, tensors, depth + 1)] for k, v in pairs]}
    raise TypeError(
        f"a checkpoint's state cannot hold a {type(value).__name__} (only tensors, numbers, text, lists, "
        "tuples and dicts of these)"
    )


def _decode(value, tensors, depth=0):
    """The inverse of _encode; a ValueError for anything _encode does not write."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_decode(item, tensors, depth + 1) for item in value]
    if not isinstance(value, dict):
        raise ValueError(f"a {type(value).__name__}")
    tag, body = next(iter(value.items())) if len(value) == 1 else (None, None)
    if tag == "__tensor__":
        if not isinstance(body, str) or body not in tensors:
            raise ValueError(f"a tensor {str(body)[:40]!r} that is not in the file")
        return tensors[body]
    if tag == "__tuple__" and isinstance(body, list):
        return tuple(_decode(item, tensors, depth + 1) for item in body)
    if tag == "__items__" and isinstance(body, list) and all(isinstance(i, list) and len(i) == 2 for i in body):
        items = [(_decode(k, tensors, depth + 1), _decode(v, tensors, depth + 1)) for k, v in body]
        if not all(isinstance(k, (str, int, float, tuple)) or k is None for k, _ in items):
            raise ValueError("a dict key that is not a string, number or tuple")
        return dict(items)
    if tag == "__ndarray__":
        dtype, shape, data = body if isinstance(body, list) and len(body) == 3 else (None, None, None)
        if not (isinstance(dtype, str) and np.dtype(dtype).kind in "biuf" and isinstance(data, list)):
            raise ValueError("an array that is not of numbers")
        if not all(type(n) is int and n >= 0 for n in shape) or int(np.prod(shape)) != len(data):
            raise ValueError("an array whose shape is not its size")
        return np.asarray(data, dtype=np.dtype(dtype)).reshape(shape)
    if tag in TAGS:
        raise ValueError(f"a {tag} that is not as the format writes it")
    return {key: _decode(item, tensors, depth + 1) for key, item in value.items()}


def state_bytes(state):
    """The bytes of state.safetensors holding `state` (a dict)."""
    tensors = {}
    meta = json.dumps(_encode(state, tensors), allow_nan=True, separators=(",", ":"))
    return save(tensors, metadata={"format": "reference-rl-state", "state": meta})


def parse_state(data):
    """The state in the bytes of a state.safetensors; a ValueError (or SafetensorError) if they are not one."""
    tensors = load(data)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    meta = header.get("__metadata__") or {}
    if meta.get("format") != "reference-rl-state" or not isinstance(meta.get("state"), str):
        raise ValueError("it is not the state file of a checkpoint of this project")
    return _decode(json.loads(meta["state"]), tensors)


# A state is read whole: one larger than this machine's memory cannot be a checkpoint it wrote (AdamW's moments of
# SmolLM2-135M's policy and critic alone are 2.2 GB: no fixed size bounds every model).
MAX_STATE_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def read_state(folder):
    """(state, the bytes it was read from) of `folder`'s state.safetensors; (None, None) if it has none. A
    UsageError if it cannot be read, or if the folder holds only an older version's state.pt (a pickle: never
    opened). The state is parsed from the bytes read once, so what is checked is what is used."""
    path = os.path.join(folder, STATE)
    if not os.path.lexists(path):
        if os.path.isfile(os.path.join(folder, OLD_STATE)):
            raise UsageError(
                f"--resume {folder!r} holds state.pt, the checkpoint format of an older version of this project, "
                "which is a pickle and could run code when read: this version does not open it; resume it with the "
                "version that wrote it, or start a new run"
            )
        return None, None
    try:
        if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) > MAX_STATE_BYTES:
            raise ValueError("not a regular file of a state's size")
        with open(path, "rb") as f:
            data = f.read()
        return parse_state(data), data
    except (OSError, ValueError, TypeError, KeyError, RecursionError, SafetensorError) as e:
        raise UsageError(
            f"--resume {folder!r}: {STATE} cannot be read ({type(e).__name__}): the checkpoint is corrupt or not "
            "one of this project's; restore it or start a new run"
        ) from None


HASHED_BYTES = 64 * 2**20  # files up to this size (configs, tokenizers, small weights) are hashed in full


def file_digest(path):
    """(size, sha256) of a file; files over HASHED_BYTES are hashed on their first and last MiB only."""
    size, digest = os.path.getsize(path), hashlib.sha256()
    with open(path, "rb") as f:
        if size <= HASHED_BYTES:
            digest.update(f.read())
        else:
            digest.update(f.read(2**20))
            f.seek(size - 2**20)
            digest.update(f.read())
    return size, digest.hexdigest()


def file_manifest(folder):
    """{relative path: (size, sha256)} of every file under `folder` but the state (which holds the manifest)."""
    manifest = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if os.path.relpath(path, folder) != STATE:
                manifest[os.path.relpath(path, folder)] = file_digest(path)
    return manifest


def data_fingerprint(examples):
    """sha256 of the training examples, in order, every field of each (a task's examples or reward_model.py's pairs,
    a `margin` as much as the prompt): a resumed run must draw its prompts from the same list, the same data."""
    keys = ("prompt", "answer", "chosen", "rejected")  # then the other fields by name, but "where" (the line it is on)
    rows = []
    for example in examples:
        other = sorted([key, value] for key, value in example.items() if key not in keys and key != "where")
        rows.append([example[key] for key in keys if key in example] + ([other] if other else []))
    return hashlib.sha256(json.dumps(rows, default=repr).encode("utf-8")).hexdigest()  # repr: what JSON cannot write


def rng_state():
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
