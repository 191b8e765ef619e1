"""Loading what a run needs, and checking it fits: models, tokenizers, device and precision.

The built-in tiny model (built by tiny_model.py), any causal LM of the hub, a folder or a .gguf file (gguf_convert.py),
with its tokenizer; the checks that refuse a misfit in one line. A --reward-model is learnt_reward.py's."""

import os
import sys

import torch

from machinery import gguf_convert, model_checks, threads
from machinery.errors import UsageError, one_line
from machinery.tiny_model import TINY_MODELS, build_tiny_model, tiny_model_dir


def resolve_model_path(name, flag="--model"):
    """`tiny`, `tiny-gpt2`: a built-in tiny model; FILE.gguf: its converted folder (both made in the cache); else as
    given."""
    if name in TINY_MODELS:
        folder = tiny_model_dir(name)
        if not os.path.isdir(folder):
            build_tiny_model(folder, name)
        return folder
    if name.lower().endswith(".gguf") and not os.path.isdir(name):  # a folder named x.gguf is a folder
        return gguf_convert.gguf_folder(name, os.path.dirname(tiny_model_dir()), flag)
    if not os.path.isdir(name) and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise UsageError(
            f"{flag} {name!r} is neither a local folder nor a hub id like Qwen/Qwen2.5-0.5B-Instruct: "
            f"fix the path{', or pass --model tiny' if flag == '--model' else ''}"
        )
    return name


def from_pretrained(loader, name, **kwargs):
    """`loader.from_pretrained(name)`; anything it raises on a folder it cannot read, or a config or weights
    transformers refuses (its own validation, a weights file that is not one), is one line naming the folder."""
    try:
        return loader.from_pretrained(name, **kwargs)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except OSError as e:  # missing, unreadable, or not on the hub
        raise UsageError(
            f"could not load {name!r} ({one_line(e, 160)}): check --model, the path or your network"
        ) from None
    except Exception as e:  # noqa: BLE001 (transformers validates configs with many kinds of errors)
        raise UsageError(
            f"could not load {name!r}: its files are invalid ({type(e).__name__}: {one_line(e, 160)}): fix its "
            "config.json or weights, or download the model again"
        ) from None


def quiet_transformers():
    from transformers.utils import logging

    logging.disable_progress_bar()  # "Loading weights" bars would bury the training progress bar


def saved_as_generic_tokenizer(path):
    """Whether a local folder's tokenizer_config.json names the generic class (as the tiny model's does)."""
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            return json.load(f).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast")
    except (OSError, ValueError):
        return False


def load_tokenizer(name, system_prompt=None):
    """The tokenizer of `name`, padding on the left, keeping `system_prompt` for chat_texts (--system-prompt)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    quiet_transformers()
    path = resolve_model_path(name)
    # AutoTokenizer rebuilds the tokenizer of a qwen2 model as Qwen's byte-level BPE from the vocabulary alone,
    # ignoring tokenizer.json: the tiny model's would silently drop spaces and unknown characters.
    loader = PreTrainedTokenizerFast if saved_as_generic_tokenizer(path) else AutoTokenizer
    tokenizer = from_pretrained(loader, path)
    tokenizer.padding_side = "left"  # generation appends to the right end of every prompt
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise UsageError(
            f"the tokenizer of {name!r} has neither a pad nor an EOS token, so no completion can end: "
            "set eos_token in its tokenizer_config.json"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.system_prompt = system_prompt
    return tokenizer


def chat_texts(tokenizer, prompts):
    """Each prompt as a user turn of the chat template, then the assistant's turn; after a system turn of
    load_tokenizer's `system_prompt` unless None (the template's own: SmolLM2's is 21 of a 46-token prompt)."""
    system = getattr(tokenizer, "system_prompt", None)
    turn = [{"role": "system", "content": system}] if system is not None else []
    try:
        return tokenizer.apply_chat_template(
            [turn + [{"role": "user", "content": p}] for p in prompts], add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # jinja's TemplateError: a template that takes no system turn (Gemma's) raises one
        if system is None:
            raise
        raise UsageError(
            f"the chat template of this tokenizer takes no system prompt ({type(e).__name__}: "
            f"{str(e)[:80]}): drop --system-prompt"
        ) from None


def load_pretrained(loader, name, device, dtype=torch.float32, missing=None, **kwargs):
    """A model by hub id or local path through `loader` (an AutoModelFor... class), with every dropout set to 0;
    the names of the weights its files lacked (made up at random by transformers) added to the list `missing`.

    Dropout would make the ratio differ from 1 at the first update (policy and old policy would
    be two different random networks), so RL fine-tuning turns it off.
    """
    from transformers import AutoConfig

    quiet_transformers()
    path = resolve_model_path(name)
    config = from_pretrained(AutoConfig, path, **kwargs)
    for key, value in vars(config).items():
        if "dropout" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    model = from_pretrained(loader, path, config=config, dtype=dtype, output_loading_info=missing is not None)
    if missing is not None:
        model, info = model
        missing += info["missing_keys"]
    for module in model.modules():  # heads whose dropout no config key sets (classifier_dropout None means 0.1)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.register_forward_pre_hook(threads.follow_before_forward)  # --threads auto: follow the idle cores
    return model.to(device)


def load_causal_lm(name, device, dtype=torch.float32):
    """A decoder-only causal LM whose forward can return the completion's logits alone; anything else is refused."""
    import inspect

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = from_pretrained(AutoConfig, resolve_model_path(name))
    if config.is_encoder_decoder or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(
            f"{name!r} is a {config.model_type} model, not a decoder-only causal LM: pass one with --model"
        )
    heads = config.architectures or []
    if heads and not any(
        head.endswith(("ForCausalLM", "LMHeadModel")) for head in heads
    ):  # its LM head would be random
        raise UsageError(f"{name!r} was saved as {', '.join(heads)}, not a causal LM: pass one with --model")
    model = load_pretrained(AutoModelForCausalLM, name, device, dtype)
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise UsageError(
            f"{name!r} ({type(model).__name__}) cannot return the completion's logits alone (no logits_to_keep): "
            "use another architecture"
        )
    model_checks.check_causal_and_finite(model, name)
    # The head reads a contiguous copy of the hidden states. With logits_to_keep they are a strided view, on which
    # torch's matmul takes one kernel for a trainable weight (no fold, to spare the gradient a copy) and another for
    # a frozen one; MKL's AVX-512 kernels round the two differently, so the policy, its frozen reference and a
    # fresh copy of the base would not compute the same bits (step 1's KL would not be 0). Contiguous: one kernel.
    model.get_output_embeddings().register_forward_pre_hook(contiguous_input)
    return model


def position_ids_from_mask(attention_mask):
    """Positions counted over real tokens only, so left padding does not shift them: [0 0 0 1 2 ...]."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def contiguous_input(module, args):
    """A forward pre-hook: the module's first input made contiguous (values unchanged)."""
    return (args[0].contiguous(), *args[1:])


def load_backbone(name, device):
    """The transformer of a causal LM without its vocabulary head (AutoModel), as the base of a critic."""
    from transformers import AutoModel
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # loaded from a causal LM, the load report lists the unused LM head: expected
    backbone = load_pretrained(AutoModel, name, device)
    logging.set_verbosity(verbosity)
    model_checks.check_causal_and_finite(backbone, name, "--critic-model")
    return backbone


HEAD_FILE = "value_head.safetensors"


def save_backbone_and_head(backbone, state_dict, folder):
    """A critic's weights (its state dict): the backbone as a transformers folder, the value head beside it."""
    from safetensors.torch import save_file

    part = lambda name: {k.split(".", 1)[1]: v.contiguous() for k, v in state_dict.items() if k.startswith(f"{name}.")}
    backbone.save_pretrained(folder, state_dict=part("backbone"))
    save_file(part("value_head"), os.path.join(folder, HEAD_FILE))


def load_head(head, name, device):
    """Load into `head` the weights saved beside the backbone `name`, if there are any (else it keeps its init)."""
    from safetensors.torch import load_file

    path = os.path.join(resolve_model_path(name), HEAD_FILE)
    if os.path.isfile(path):
        head.load_state_dict(load_file(path, device=str(device)))


def same_text(a, b):
    """Equal up to Unicode compatibility forms (NFKC) and runs of whitespace, which tokenizers may rewrite."""
    import unicodedata

    plain = [" ".join(unicodedata.normalize("NFKC", text).split()) for text in (a, b)]
    return a == b or plain[0] == plain[1]


def unwritable_characters(tokenizer, texts):
    """The characters of `texts` the tokenizer cannot write: tokenized and decoded alone, they do not come back
    (an unknown one comes back as <unk>). Each distinct character is tried once, so this is fast for any task."""
    chars = sorted(set().union(*texts))
    if not chars:  # every text empty (answers of "")
        return set()
    decoded = tokenizer.batch_decode(tokenizer(chars, add_special_tokens=False)["input_ids"], skip_special_tokens=False)
    return {c for c, d in zip(chars, decoded) if not same_text(c, d)}


def note(message):
    print(f"note: {message}", file=sys.stderr)


def check_vocabulary(tokenizer, task, model_name):
    """Refuse a task whose prompts (all of them, train and held out) have characters the tokenizer does not know,
    or whose answers it could not write (Task.answers: refused if "written", a note if "yours")."""
    advice = (
        "use a hub model with --model, or a task the tiny model reads (copy, arithmetic)"
        if model_name in TINY_MODELS
        else "use a model whose tokenizer has them, or remove them from the task"
    )
    examples = task.train + task.test
    for key in ("prompt", "answer"):
        texts = [example[key] for example in examples]
        unknown = unwritable_characters(tokenizer, texts) if key == "prompt" or task.answers != "data" else None
        if not unknown:
            continue
        bad = [text for text in texts if not unknown.isdisjoint(text)]
        char = next(c for c in bad[0] if c in unknown)
        which = f"{len(bad)} of the {len(texts)} {key}s of task {task.name!r} {'has' if len(bad) == 1 else 'have'}"
        if key == "prompt":
            raise UsageError(
                f"{which} characters the tokenizer of {model_name!r} does not know "
                f"(e.g. {char!r} in {bad[0][:60]!r}): {advice}"
            )
        message = (
            f"{which} characters the tokenizer of {model_name!r} cannot write (e.g. {char!r} in {bad[0][:60]!r}), "
            "so no completion can match them"
        )
        if task.answers == "yours":
            note(f"{message}; if your reward compares completions with answers, {advice}")
        else:
            raise UsageError(f"{message}: {advice}")


def token_counts(tokenizer, texts, chat_template=None, chunk_chars=2**20):
    """Tokens of each text, one at a time (no padding): as generation encodes a prompt (chat_template True or
    False, see generation.encode_prompts), or as a completion writes an answer (None: no special tokens). Tokenized
    about `chunk_chars` characters a call: a signal (Ctrl-C, SIGTERM) is handled between calls, never held up by
    one long call into the tokenizer."""
    if not texts:
        return []
    if chat_template and tokenizer.chat_template:
        texts = chat_texts(tokenizer, texts)
    special = chat_template is not None and not (chat_template and tokenizer.chat_template)  # as encode_prompts
    counts, start = [], 0
    while start < len(texts):
        end, size = start, 0
        while end < len(texts) and (end == start or size + len(texts[end]) <= chunk_chars):
            size, end = size + len(texts[end]), end + 1
        counts += [len(ids) for ids in tokenizer(texts[start:end], add_special_tokens=special)["input_ids"]]
        start = end
    return counts


def longest(tokenizer, texts, budget, chat_template=None, slack=8):
    """(length, text) of the longest of `texts` in tokens, and how many are longer than `budget`; only the texts
    that may exceed the budget are tokenized. A text has at most as many tokens as UTF-8 bytes (+ `slack` for
    a prefix space), plus the chat template's own tokens, so short texts are counted as that bound."""
    overhead = token_counts(tokenizer, [""], chat_template)[0] + slack
    bounds = [len(text.encode("utf-8", "surrogatepass")) + overhead for text in texts]
    maybe = [i for i, bound in enumerate(bounds) if bound > budget]
    counts = token_counts(tokenizer, [texts[i] for i in maybe], chat_template)
    over = [(n, texts[i]) for i, n in zip(maybe, counts) if n > budget]
    return max(over, default=(0, "")), len(over)


def check_prompt_length(tokenizer, task, model, model_name, max_new_tokens, chat_template):
    """Refuse a task one of whose prompts (train or held out), as generation encodes it, plus max_new_tokens
    overflows the model's positions, and one with answers of more tokens than max_new_tokens, which no
    completion can write (Task.answers "written" is refused, "yours" gets a note). The advice leaves room
    for the EOS too: an answer cut off without its EOS may score, but PPO's --missing-eos-penalty hits it.

    Each prompt is measured on its own, never padded into a batch; one of more characters than the positions
    could hold (positions times the longest token) is refused before it is tokenized: a 4 MB line costs nothing.
    """
    model_checks.check_chat_template(tokenizer, model_name, chat_template)  # before it encodes any prompt
    limit = getattr(model.config, "max_position_embeddings", None)
    examples = task.train + task.test
    prompts = [example["prompt"] for example in examples]
    if limit:
        max_chars = limit * max(map(len, tokenizer.get_vocab()))
        if len(huge := max(prompts, key=len)) > max_chars:
            raise UsageError(
                f"a prompt of task {task.name!r} is {len(huge)} characters ({huge[:40]!r}...), more than the {limit} "
                f"positions of {model_name!r} can hold: shorten the prompts"
            )
        (length, prompt), over = longest(tokenizer, prompts, limit - max_new_tokens, chat_template)
        if over:
            fix = (
                f"lower --max-new-tokens to {limit - length} or shorten the prompts"
                if length < limit
                else "shorten the prompts"
            )
            raise UsageError(
                f"a prompt of task {task.name!r} is {length} tokens ({prompt[:40]!r}...); with --max-new-tokens "
                f"{max_new_tokens} that is more than the {limit} positions of {model_name!r}: {fix}"
            )
    if task.answers == "data":
        return
    (length, answer), over = longest(tokenizer, [example["answer"] for example in examples], max_new_tokens, slack=1)
    if not over:
        return
    fix = f"raise --max-new-tokens to {length + 1} (its tokens and the EOS)"
    if limit and length + 1 + longest(tokenizer, prompts, 0, chat_template)[0][0] > limit:
        fix = (
            "shorten the answers, or the prompts: the longest prompt and answer do not fit in the "
            f"{limit} positions of {model_name!r}"
        )
    message = (
        f"task {task.name!r} has {over} answer{'s' * (over != 1)} longer than --max-new-tokens {max_new_tokens} "
        f"tokens (the longest, {answer[:40]!r}, is {length} tokens)"
    )
    if task.answers == "yours":
        note(f"{message}; if your reward compares completions with answers, {fix}")
    else:
        raise UsageError(f"{message}: {fix}")


def eos_token_ids(model, tokenizer):
    """Every id that ends a completion: the generation config's list (chat models have several) and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    model_checks.check_token_ids(model, tokenizer, ids, model.name_or_path)
    return ids


CPU = torch.device("cpu")  # where a checkpoint's weights are read before they are copied into the run's models
