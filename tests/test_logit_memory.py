"""A long completion's memory: its log-probs computed with the output head a chunk of positions at a time (so the
[rows, T, vocab] logits never exist, machinery/output_head.py), the same values and gradients as the textbook
full softmax, the model's own logits where it changes the head's output (a softcap), and --gradient-checkpointing
auto, chosen by the memory bound (model_checks.choose_checkpointing)."""

import pytest
import torch
from conftest import make_small_model
from test_logprobs import assert_grad_close, plain_logprobs, ragged_batch

import common
import grpo
from machinery import model_checks, output_head
from machinery.tiny_model import TINY_MODEL


def head_output_positions(model):
    """The positions of each output of the model's head, recorded as it runs ([rows, positions, vocab] or
    [positions, vocab])."""
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: seen.append(out.shape[:-1].numel()))
    return seen


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_the_head_runs_a_chunk_at_a_time_with_the_textbook_values_and_gradients(kind):
    """With 4 positions a chunk, the 15 completion positions of 3 rows go through the head 4 at a time (plus one
    position a row, where the model's own logits are checked): never all at once. Values, entropies and gradients
    are the full softmax's."""
    model = make_small_model(kind)
    input_ids, attention_mask, completion_mask = ragged_batch()
    weights = torch.randn(completion_mask.shape, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    expected_logp, expected_entropy = plain_logprobs(model, input_ids, attention_mask, completion_mask, 0.7)
    expected_grads = torch.autograd.grad((expected_logp * weights).sum(), params)
    seen = head_output_positions(model)
    logp, entropy = common.token_logprobs(
        model, input_ids, attention_mask, completion_mask, 0.7, chunk_tokens=4, return_entropy=True
    )
    grads = torch.autograd.grad((logp * weights).sum(), params)
    assert max(seen) <= 4 and sum(n for n in seen if n == 4) >= 12, seen  # 15 positions: 4 + 4 + 4 + 3
    torch.testing.assert_close(logp.detach(), expected_logp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.detach(), atol=1e-5, rtol=1e-5)
    for g, eg in zip(grads, expected_grads):
        assert_grad_close(g, eg)
    seen.clear()
    common.token_logprobs(model, input_ids, attention_mask, completion_mask, 0.7)  # one chunk: the model's logits
    assert seen == [3 * 6], seen  # the last 6 positions of each row (logits_to_keep = T + 1), as before


def softcapped_model():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        initializer_range=0.5,
        final_logit_softcapping=2.0,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).eval()


def test_a_model_that_changes_its_heads_output_gets_its_own_logits():
    """Gemma 2 softcaps the head's output: the check sees that its logits are not the head's, and the log-probs
    come from the model's own logits (a second forward, once), then the model is remembered."""
    model = softcapped_model()
    input_ids, attention_mask, completion_mask = ragged_batch()
    expected, _ = plain_logprobs(model, input_ids, attention_mask, completion_mask, 0.5)
    seen = head_output_positions(model)
    with torch.no_grad():
        first = common.token_logprobs(model, input_ids, attention_mask, completion_mask, 0.5, chunk_tokens=4)
        assert model.get_output_embeddings() in output_head.TRANSFORMED
        seen.clear()
        again = common.token_logprobs(model, input_ids, attention_mask, completion_mask, 0.5, chunk_tokens=4)
    assert seen == [3 * 6]  # remembered: one forward, its logits whole
    torch.testing.assert_close(first, expected.detach(), atol=1e-5, rtol=1e-5)
    assert torch.equal(again, first)
    assert make_small_model().get_output_embeddings() not in output_head.TRANSFORMED


def smollm2_config():
    """SmolLM2-135M's shape (vocabulary 49,152, hidden 576, MLP 1536, 30 layers, 9 heads of 64, 3 KV heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )


def test_activation_bytes_counts_by_hand():
    """Per token and layer 4 hidden-wide and 4 MLP-wide tensors; a micro-batch of 8 holds the 6 rows there are, of
    max_new_tokens + 1 positions; 4 bytes in float32, else 2."""
    config = smollm2_config()
    args = grpo.Args(prompts_per_step=3, group_size=2, max_new_tokens=7, micro_batch_size=8, dtype="float32")
    assert model_checks.activation_bytes(args, config) == 6 * 8 * 30 * 4 * (576 + 1536) * 4
    args.dtype = "auto"
    assert model_checks.activation_bytes(args, config) == 6 * 8 * 30 * 4 * (576 + 1536) * 2


@pytest.mark.parametrize(
    "max_new_tokens, given, expected",
    [(512, "auto", "on"), (384, "auto", "on"), (256, "auto", "off"), (16, "auto", "off"), (512, "off", "off")],
)
def test_checkpointing_auto_is_on_where_activations_outweigh_the_rest_of_the_step(max_new_tokens, given, expected):
    """SmolLM2's GRPO step of 2 prompts x 4 completions in micro-batches of 8, float32, --beta 0: 512 tokens hold
    ~3.9 GiB of activations against 2.6 GiB for the rest (on); 256 hold 1.9 against 2.4 (off); off stays off."""
    args = grpo.Args(
        model="x",
        prompts_per_step=2,
        group_size=4,
        micro_batch_size=8,
        beta=0.0,
        dtype="float32",
        max_new_tokens=max_new_tokens,
        gradient_checkpointing=given,
    )
    config = smollm2_config()
    activations, rest = model_checks.activation_bytes(args, config), model_checks.step_bytes(args, config)[0]
    assert (activations > rest) == (expected == "on") or given != "auto"
    on, reason = model_checks.choose_checkpointing(args, config)
    assert on == (expected == "on") and reason.startswith("auto: " if given == "auto" else "--gradient-checkpointing")
    assert args.gradient_checkpointing == given  # the Args keep what was given: a resume compares that


def torchrun_case(max_new_tokens, micro_batch_size):
    """SmolLM2's GRPO step of 2 prompts x 8 completions, float32, --beta 0: 16 rows, 8 a process on 2 processes."""
    return grpo.Args(
        model="x",
        prompts_per_step=2,
        group_size=8,
        micro_batch_size=micro_batch_size,
        beta=0.0,
        dtype="float32",
        max_new_tokens=max_new_tokens,
    )


def test_activation_bytes_count_a_process_rows_under_torchrun():
    """On 2 processes each holds 8 of the 16 rows: a micro-batch of 16 holds 8, half the activations of 1 process;
    a micro-batch of 4 holds 4 either way."""
    config = smollm2_config()
    per_row = 30 * 4 * (576 + 1536) * 4 * 129  # 30 layers, 4 + 4 tensors, float32, 128 + 1 positions
    assert model_checks.activation_bytes(torchrun_case(128, 16), config) == 16 * per_row
    assert model_checks.activation_bytes(torchrun_case(128, 16), config, 2) == 8 * per_row
    assert model_checks.activation_bytes(torchrun_case(128, 4), config, 2) == 4 * per_row


@pytest.mark.parametrize(
    "max_new_tokens, micro_batch_size, one, two",
    [(128, 16, False, False), (256, 8, False, True), (192, 16, True, True)],
)
def test_checkpointing_auto_weighs_one_process_share_under_torchrun(
    max_new_tokens, micro_batch_size, one, two, monkeypatch, capsys
):
    """Under torchrun each process weighs its own share, activations and the rest alike: 128 tokens in
    micro-batches of 16 hold 1.95 GiB of activations on 1 process, 0.97 on each of 2 (off, under 1 GiB: weighed
    as 1 process's against the 2 processes' sharded rest, 1.3 GiB, they would be on); 256 tokens in micro-batches
    of 8 hold 1.94 GiB either way, against a rest of 2.5 GiB on 1 process (off) and 1.41 on 2 (on). The start-up
    reads the number of processes from torchrun's WORLD_SIZE."""
    from machinery import startup

    args, config = torchrun_case(max_new_tokens, micro_batch_size), smollm2_config()
    assert model_checks.choose_checkpointing(args, config)[0] == one
    assert model_checks.choose_checkpointing(args, config, 2)[0] == two
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert startup.checkpointing(args, config) == one
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert startup.checkpointing(args, config) == two
    assert f"activation checkpointing: {'on' if two else 'off'} (auto: " in capsys.readouterr().out


def test_checkpointing_auto_leaves_a_small_step_alone():
    """The tiny model's default step, whose activations (12 MiB) outweigh its weights (18 MiB with the rest) at a
    few more tokens, stays off: below CHECKPOINTING_FLOOR nothing worth recomputing for."""
    from transformers import AutoConfig

    from machinery import models

    config = AutoConfig.from_pretrained(models.resolve_model_path(TINY_MODEL))
    args = grpo.Args(max_new_tokens=20)
    assert model_checks.activation_bytes(args, config) > model_checks.step_bytes(args, config)[0]
    assert not model_checks.choose_checkpointing(args, config)[0]


@pytest.mark.parametrize("given", ["on", "off"])
def test_a_policy_that_recomputes_its_activations_keeps_no_freed_memory(given, monkeypatch):
    """threads.keep_freed_memory (a heap that only grows, for speed) is asked only where the activations are kept:
    with checkpointing on, SmolLM2's 512-token peak grew past AdamW's state from step to step with it."""
    from machinery import models, precision, startup, threads

    asked = []
    monkeypatch.setattr(threads, "keep_freed_memory", lambda model, device: asked.append(model))
    _, policy = startup.load_policy(grpo.Args(gradient_checkpointing=given), models.CPU)
    assert precision.activation_checkpointing(policy) == (given == "on")
    assert len(asked) == (given == "off")
