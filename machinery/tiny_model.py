"""The built-in tiny models (--model tiny, tiny-gpt2): a character-level tokenizer and a ~1M-parameter model with
random weights, built once into the cache and then loaded like any hub model (models.resolve_model_path)."""

import os
import shutil

import torch

TINY_MODEL = "tiny"
# The same tiny model as GPT-2, whose positions are learned and absolute: a position id that ignores left padding
# changes its log-probs, where the rotary positions of `tiny` are blind to that uniform shift (verify.py's dumps).
TINY_GPT2_MODEL = "tiny-gpt2"
TINY_MODELS = (TINY_MODEL, TINY_GPT2_MODEL)
TINY_CHARS = "0123456789+-*/=() ,.:?"  # enough for every built-in task
TINY_VERSION = 1  # bump when the recipe below changes, so old cached copies are rebuilt


def tiny_model_dir(name=TINY_MODEL):
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    kind = "gpt2" if name == TINY_GPT2_MODEL else "qwen2"
    return os.path.join(cache, "ppo-grpo-reference", f"tiny-{kind}-v{TINY_VERSION}")


def build_tiny_model(folder, name=TINY_MODEL):
    """Write a built-in tiny model: a character-level tokenizer and a ~1M-parameter Qwen2 (`tiny`) or GPT-2
    (`tiny-gpt2`: learned absolute positions), random init.

    It is saved like any hub model, so it then goes through the same AutoModel/AutoTokenizer path.
    The init is seeded, so every machine builds the same weights.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(TINY_CHARS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()  # join characters back without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=None,
    )
    model_class = Qwen2ForCausalLM
    if name == TINY_GPT2_MODEL:
        config = GPT2Config(
            vocab_size=len(vocab),
            n_embd=128,
            n_layer=4,
            n_head=4,
            n_positions=256,
            tie_word_embeddings=True,
            pad_token_id=vocab["<pad>"],
            eos_token_id=vocab["<eos>"],
            bos_token_id=None,
        )
        model_class = GPT2LMHeadModel
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = model_class(config)
    tmp = f"{folder}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    if os.path.isdir(folder):  # another process built it meanwhile
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, folder)
