"""common.token_logprobs against a plain full-softmax computation, and micro-batching against one batch."""

import pytest
import torch
import torch.nn.functional as F
from conftest import make_small_model

import common
import grpo
import ppo
from machinery import generation, precision

PAD = 0


def assert_grad_close(grad, expected):
    """Close up to float32 summation order: these gradients reach ~50, so the tolerance scales with them."""
    torch.testing.assert_close(grad, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-4)


def ragged_batch():
    """Three rows: prompts of length 4, 2 and 1 (left-padded to 4), completions of 5 tokens right-masked to 5, 3, 1."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(2, 32, (3, 4), generator=g)
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    prompt_ids[prompt_mask == 0] = PAD
    completion_ids = torch.randint(2, 32, (3, 5), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    return input_ids, attention_mask, completion_mask


def plain_logprobs(model, input_ids, attention_mask, completion_mask, temperature):
    """The textbook way: full logits, log_softmax at the temperature, then pick the next token, row by row."""
    position_ids = torch.zeros_like(input_ids)  # a real token's position counts the real tokens before it
    for b, row in enumerate(attention_mask.tolist()):
        real = [t for t, m in enumerate(row) if m]
        position_ids[b, real] = torch.arange(len(real))
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logprobs = F.log_softmax(logits.float() / temperature, dim=-1)  # [B, L, V]
    B, T = completion_mask.shape
    P = input_ids.shape[1] - T
    logp = torch.zeros(B, T)
    entropy = torch.zeros(B, T)
    for b in range(B):
        for t in range(T):
            if completion_mask[b, t]:
                dist = logprobs[b, P + t - 1]  # the logits at position P + t - 1 predict token P + t
                logp[b, t] = dist[input_ids[b, P + t]]
                entropy[b, t] = -(dist.exp() * dist).sum()
    return logp, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_full_softmax(small_model, temperature):
    input_ids, attention_mask, completion_mask = ragged_batch()
    with torch.no_grad():
        logp, entropy = common.token_logprobs(
            small_model, input_ids, attention_mask, completion_mask, temperature, return_entropy=True
        )
        expected_logp, expected_entropy = plain_logprobs(
            small_model, input_ids, attention_mask, completion_mask, temperature
        )
    torch.testing.assert_close(logp, expected_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=1e-5)
    assert (logp[completion_mask == 0] == 0).all() and (entropy[completion_mask == 0] == 0).all()


def grouped_batch(width=5):
    """Two groups of three completions each sharing a prompt of 4 positions (the second left-padded), as GRPO lays out
    a batch; completions `width` wide (5: longer than the prompt, 2: shorter)."""
    input_ids, attention_mask, completion_mask = ragged_batch()
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    g = torch.Generator().manual_seed(2)
    input_ids, attention_mask = input_ids[rows, : 4 + width].clone(), attention_mask[rows, : 4 + width].clone()
    input_ids[:, 4:] = torch.randint(2, 32, (6, width), generator=g)  # each completion its own
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]] * 2)[:, :width]
    attention_mask[:, 4:] = completion_mask
    return input_ids, attention_mask, completion_mask


@pytest.mark.parametrize("width", [5, 2])
def test_a_shared_prompt_gives_the_plain_forwards_values_and_gradients(small_model, width):
    """Each group's prompt computed once (prompt_cache.py) gives the textbook log-probs and their gradients, whether
    the completions are wider than the prompts or narrower."""
    from machinery import prompt_cache

    input_ids, attention_mask, completion_mask = grouped_batch(width)
    first, run = prompt_cache.prompt_runs(input_ids[:, :4], attention_mask[:, :4])
    assert first.tolist() == [0, 3] and run.tolist() == [0, 0, 0, 1, 1, 1]  # so the shared path runs below
    positions = common.position_ids_from_mask(attention_mask)
    assert prompt_cache.shared_prompt_cache(small_model, input_ids, attention_mask, positions, 4).get_seq_length() == 3
    weights = torch.randn(completion_mask.shape, generator=torch.Generator().manual_seed(1))
    params = list(small_model.parameters())
    logp = common.token_logprobs(small_model, input_ids, attention_mask, completion_mask, 0.7)
    grads = torch.autograd.grad((logp * weights).sum(), params)
    expected = plain_logprobs(small_model, input_ids, attention_mask, completion_mask, 0.7)[0]
    expected_grads = torch.autograd.grad((expected * weights).sum(), params)
    torch.testing.assert_close(logp.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    for g, eg in zip(grads, expected_grads):
        assert_grad_close(g, eg)


@pytest.mark.exact
def test_a_shared_prompt_samples_the_same_completions(tiny_model, tiny_tokenizer, monkeypatch):
    """generate() continuing from each group's shared prompt cache draws the same tokens as from 12 prompts."""
    from machinery import prompt_cache

    prompts = [p for p in ("12+7=", "3=", "456+1=") for _ in range(4)]
    ids, mask = generation.encode_prompts(tiny_tokenizer, prompts).values()
    assert (
        prompt_cache.shared_prompt_cache(tiny_model, ids, mask, common.position_ids_from_mask(mask), ids.shape[1])
        is not None
    )
    torch.manual_seed(0)
    shared = generation.generate(tiny_model, tiny_tokenizer, prompts, 6, 1.0, [tiny_tokenizer.eos_token_id])
    every_row = lambda ids, mask: (torch.arange(len(ids)), torch.arange(len(ids)))
    monkeypatch.setattr(prompt_cache, "prompt_runs", every_row)  # no two rows share: the plain path
    torch.manual_seed(0)
    plain = generation.generate(tiny_model, tiny_tokenizer, prompts, 6, 1.0, [tiny_tokenizer.eos_token_id])
    for a, b in zip(shared, plain):
        assert torch.equal(a, b)
    assert len({tuple(row) for row in shared[2].tolist()}) > 3  # sampled, not all alike


def test_temperature_changes_the_logprobs(small_model):
    """Guards the test above: with this model the temperature matters far beyond its tolerance."""
    input_ids, attention_mask, completion_mask = ragged_batch()
    with torch.no_grad():
        at_1 = common.token_logprobs(small_model, input_ids, attention_mask, completion_mask, 1.0)
        at_07 = common.token_logprobs(small_model, input_ids, attention_mask, completion_mask, 0.7)
    assert (at_1 - at_07)[completion_mask.bool()].abs().max() > 0.1


def test_left_padding_does_not_change_a_row(small_model):
    prompt, completion = torch.tensor([[5, 9, 3]]), torch.tensor([[7, 11, 4, 20]])
    completion_mask = torch.tensor([[1, 1, 1, 0]])
    with torch.no_grad():
        rows = []
        for n_pads in (0, 1, 4):
            input_ids = torch.cat([torch.full((1, n_pads), PAD), prompt, completion], 1)
            attention_mask = torch.cat(
                [torch.zeros(1, n_pads, dtype=torch.long), torch.ones_like(prompt), completion_mask], 1
            )
            rows.append(common.token_logprobs(small_model, input_ids, attention_mask, completion_mask, 1.0))
    torch.testing.assert_close(rows[1], rows[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows[2], rows[0], atol=1e-5, rtol=1e-5)


def test_small_chunks_give_the_same_values_and_gradients(small_model):
    input_ids, attention_mask, completion_mask = ragged_batch()
    weights = torch.randn(completion_mask.shape, generator=torch.Generator().manual_seed(1))
    params = list(small_model.parameters())

    def values_and_grads(fn):
        logp = fn()
        return logp.detach(), torch.autograd.grad((logp * weights).sum(), params)

    expected, expected_grads = values_and_grads(
        lambda: plain_logprobs(small_model, input_ids, attention_mask, completion_mask, 0.7)[0]
    )
    for chunk_tokens in (1, 4, 1024):
        logp, grads = values_and_grads(
            lambda: common.token_logprobs(
                small_model, input_ids, attention_mask, completion_mask, 0.7, chunk_tokens=chunk_tokens
            )
        )
        torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
        for g, eg in zip(grads, expected_grads):
            assert_grad_close(g, eg)


def test_entropy_gradient_matches_full_softmax(small_model):
    """With entropy_grad the entropy carries the gradient of the full-softmax entropy, chunked or not; without
    it the entropy is a constant (a loss `- c * entropy` would change the printed loss and not the gradient)."""
    input_ids, attention_mask, completion_mask = ragged_batch()
    weights = torch.randn(completion_mask.shape, generator=torch.Generator().manual_seed(2))
    params = list(small_model.parameters())
    plain_entropy = plain_logprobs(small_model, input_ids, attention_mask, completion_mask, 0.7)[1]
    expected = torch.autograd.grad((plain_entropy * weights).sum(), params)
    assert max(g.abs().max().item() for g in expected) > 1e-3  # an entropy that the weights move
    for chunk_tokens in (1, 4, 1024):
        _, entropy = common.token_logprobs(
            small_model,
            input_ids,
            attention_mask,
            completion_mask,
            0.7,
            chunk_tokens,
            return_entropy=True,
            entropy_grad=True,
        )
        for g, eg in zip(torch.autograd.grad((entropy * weights).sum(), params), expected):
            assert_grad_close(g, eg)
    _, constant = common.token_logprobs(
        small_model, input_ids, attention_mask, completion_mask, 0.7, return_entropy=True
    )
    assert not constant.requires_grad


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_token_logprobs_with_final_logit_softcapping(temperature):
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
    model = Gemma2ForCausalLM(config).eval()
    input_ids, attention_mask, completion_mask = ragged_batch()
    with torch.no_grad():
        logp = common.token_logprobs(model, input_ids, attention_mask, completion_mask, temperature)
        expected, _ = plain_logprobs(model, input_ids, attention_mask, completion_mask, temperature)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------
# Micro-batching: the sum of the micro-batch losses has the gradient of the one-batch loss.
# ---------------------------------------------------------------------------------------------------


def six_completions():
    g = torch.Generator().manual_seed(2)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    input_ids = torch.randint(2, 32, (6, 7), generator=g)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.3, -0.2])
    return input_ids, attention_mask, completion_mask, advantages


def one_batch_reference_loss(per_token, mask, agg, max_new_tokens):
    """The one-batch loss of each mode written out over python lists, independent of aggregate_loss."""
    rows = [[v for v, m in zip(r, mr) if m] for r, mr in zip(per_token, mask.tolist())]
    if agg == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if agg == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    return sum(sum(r) for r in rows) / (len(rows) * max_new_tokens)


@pytest.mark.parametrize("agg", grpo.LOSS_AGGREGATIONS)
def test_micro_batches_give_the_one_batch_gradient(agg):
    model = make_small_model()
    ref_model = make_small_model(seed=1)
    params = list(model.parameters())
    input_ids, attention_mask, mask, advantages = six_completions()
    N, num_tokens, max_new_tokens, beta = 6, int(mask.sum()), 5, 0.1
    with torch.no_grad():
        # An old policy a little away from the current one, so the ratio moves and the clip acts.
        noise = 0.6 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
        old_logp = common.token_logprobs(model, input_ids, attention_mask, mask, 1.0) + noise * mask
        ref_logp = common.token_logprobs(ref_model, input_ids, attention_mask, mask, 1.0)

    def loss_of(mb):
        new_logp = common.token_logprobs(model, input_ids[mb], attention_mask[mb], mask[mb], 1.0)
        logratio = new_logp - old_logp[mb]
        pg_loss = grpo.clipped_policy_loss(logratio, advantages[mb, None], 0.2, 0.28)
        per_token = pg_loss + beta * ppo.kl_estimate(new_logp, ref_logp[mb], "k3")
        return grpo.aggregate_loss(per_token, mask[mb], agg, N, num_tokens, max_new_tokens), per_token, logratio

    one_batch, per_token, logratio = loss_of(slice(0, 6))
    assert one_batch.item() == pytest.approx(
        one_batch_reference_loss(per_token.tolist(), mask, agg, max_new_tokens), rel=1e-5
    )
    assert 0 < common.clip_fraction(logratio, advantages[:, None], 0.2, 0.28, mask) < 1  # the clip acts on some tokens
    expected_grads = torch.autograd.grad(one_batch, params)
    for split in ([slice(0, 2), slice(2, 6)], [slice(0, 3), slice(3, 6)], [slice(i, i + 1) for i in range(6)]):
        total = sum(loss_of(mb)[0] for mb in split)
        assert total.item() == pytest.approx(one_batch.item(), rel=1e-5)
        for g, eg in zip(torch.autograd.grad(total, params), expected_grads):
            assert_grad_close(g, eg)


def test_plain_attention_decodes_only_on_a_cpu_under_bf16_and_while_small():
    """common.decoding_attention: "eager" meanwhile on a CPU under bfloat16 autocast (the model's own setting back
    after, an error included), SDPA kept in float32 and once one layer's attention weights would pass the bound."""
    model = make_small_model("qwen2")
    assert model.config._attn_implementation == "sdpa"
    small, _, _ = grouped_batch()  # 6 rows x 9 tokens
    large = torch.zeros(256, 256, dtype=torch.long)  # 256 x 4 heads x 256^2 > PLAIN_ATTENTION_MAX
    seen = []
    for dtype, ids, new_tokens in (
        (torch.bfloat16, small, 16),
        (torch.float32, small, 16),
        (torch.bfloat16, large, 0),
        (torch.bfloat16, small, 1000),
    ):
        with (
            torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32),
            precision.decoding_attention(model, ids, new_tokens),
        ):
            seen.append(model.config._attn_implementation)
        assert model.config._attn_implementation == "sdpa"
    assert seen == ["eager", "sdpa", "sdpa", "sdpa"]
    with (
        pytest.raises(RuntimeError),
        torch.autocast("cpu", dtype=torch.bfloat16),
        precision.decoding_attention(model, small, 16),
    ):
        raise RuntimeError
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.exact
def test_bf16_log_probs_of_the_policy_and_a_copy_agree_to_the_bit_whatever_the_rows():
    """Under bf16 autocast every log-prob of a step comes from one kernel, whatever the rows of the call: a copy of
    the policy (the reference) gives the same log-probs (the step-1 KL is 0), and slices of the batch (PPO's old
    log-probs against its minibatches) give what the whole batch gives."""
    import copy

    model = make_small_model("qwen2")
    reference = copy.deepcopy(model).requires_grad_(False)
    input_ids, attention_mask, completion_mask = grouped_batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = common.token_logprobs(model, input_ids, attention_mask, completion_mask, 0.7)
        ref = common.token_logprobs(reference, input_ids, attention_mask, completion_mask, 0.7)
        rows = [
            common.token_logprobs(
                model, input_ids[i : i + 3], attention_mask[i : i + 3], completion_mask[i : i + 3], 0.7
            )
            for i in (0, 3)
        ]
    assert torch.equal(whole, ref)
    torch.testing.assert_close(torch.cat(rows), whole, atol=0, rtol=0)


def test_log_probs_attend_in_float32_only_on_a_cpu_under_bf16(monkeypatch):
    """precision.log_prob_attention: under bf16 autocast on a CPU, token_logprobs' attention runs in float32 (its
    values float32, autocast off; the gradient flows through, the model's own kernel back after); under float32,
    or with activation checkpointing (whose backward runs the layer again), the model's kernel as it was."""
    model = make_small_model("qwen2")
    input_ids, attention_mask, completion_mask = grouped_batch()
    sdpa, seen = F.scaled_dot_product_attention, set()

    def spy(query, key, value, *args, **kwargs):  # the dtype autocast would run it in, and whether it is on
        seen.add((value.dtype, torch.is_autocast_enabled("cpu")))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for dtype, checkpointing, expected in (
        (torch.bfloat16, False, (torch.float32, False)),
        (torch.float32, False, (torch.float32, False)),
        (torch.bfloat16, True, (torch.bfloat16, True)),
    ):
        precision.set_activation_checkpointing(model, checkpointing)
        model.train(checkpointing)  # transformers recomputes layers only in train mode
        seen.clear()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logp = common.token_logprobs(model, input_ids, attention_mask, completion_mask, 0.7)
        logp.sum().backward()
        assert model.config._attn_implementation == "sdpa"
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        model.zero_grad()
        assert seen == {expected}, (dtype, checkpointing, seen)


@pytest.mark.exact
def test_plain_attention_computes_what_sdpa_does(small_model, tiny_model, tiny_tokenizer):
    """The kernel decoding_attention switches to is the same attention: log-probs and gradients (the prompt shared, as
    GRPO's groups are) agree with SDPA's in float32, and the same seed samples the same completions."""
    input_ids, attention_mask, completion_mask = grouped_batch()
    results = {}
    for kernel in ("sdpa", "eager"):
        small_model.set_attn_implementation(kernel)
        logp = common.token_logprobs(small_model, input_ids, attention_mask, completion_mask, 0.7)
        results[kernel] = (logp.detach(), *torch.autograd.grad(logp.sum(), list(small_model.parameters())))
    small_model.set_attn_implementation("sdpa")
    torch.testing.assert_close(results["eager"][0], results["sdpa"][0], atol=1e-5, rtol=1e-5)
    for g, expected in zip(results["eager"][1:], results["sdpa"][1:]):
        assert_grad_close(g, expected)
    prompts, eos = [p for p in ("12+7=", "3=", "456+1=") for _ in range(4)], [tiny_tokenizer.eos_token_id]
    samples = []
    for kernel in ("sdpa", "eager"):
        tiny_model.set_attn_implementation(kernel)
        torch.manual_seed(0)
        samples.append(generation.generate(tiny_model, tiny_tokenizer, prompts, 6, 1.0, eos))
    tiny_model.set_attn_implementation("sdpa")
    for a, b in zip(*samples):
        assert torch.equal(a, b)
