"""Every decoder-only architecture a user is likely to train, as a tiny random model: log-probs, critic, reloading
and gradients.

For each architecture (2 layers, hidden 32, vocabulary 96, a wide init so the logits differ a lot between tokens,
embeddings tied or not as the architecture's config does by default) on a batch of 3 left-padded rows:
1. common.token_logprobs (and its entropy) equals each row's unpadded ids fed alone, then log_softmax(logits / temp)
   picked at the next token; and the batched forward given the positions that generate() computes under left
   padding (attention_mask.cumsum(-1) - 1, clamped at 0). In transformers 5 a forward without position_ids uses
   arange positions, which under left padding shifts every row but the longest by its padding. Rotary embeddings
   are relative and do not notice (up to rounding), but GPT-2's learned absolute positions do
   (test_positions_must_be_passed), so the positions must be passed, as generate() computes them.
2. ppo.load_critic builds from the saved causal LM (no tokenizer needed) with the LM's backbone weights; its values
   start at 0 and, with a random head, are the head on the hidden state before each token, row by row.
3. models.load_causal_lm reloads the saved folder with the same log-probs.
4. In train mode (as the update loop runs it) the reloaded model gives the same log-probs (dropout is off: GPT-2's
   config has 0.1) and every parameter gets a finite gradient.
The distinctive logit transforms are on with values far from 1: Granite's logits_scaling, Cohere's logit_scale,
Gemma 2's and Gemma 3's final_logit_softcapping, Falcon-H1's lm_head_multiplier (and its other multipliers);
test_logit_transforms_matter checks that skipping them would fail the comparisons above. Sliding windows (Mistral,
Gemma 2, Gemma 3) are shorter than the rows, so they are in effect.

transformers 5.24 builds every one of them on the CPU. Falcon-H1's Mamba-2 mixer runs the reference PyTorch
implementation there (causal_conv1d and mamba_ssm are CUDA kernels, not installed): slow, but tested here.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers

import common
import ppo
from machinery import models

CPU = torch.device("cpu")
PAD, EOS, VOCAB = 0, 1, 96
TEMPERATURE = 0.7
CLOSE = dict(atol=1e-5, rtol=1e-6)  # float32 rounding: these log-probs reach -20, where one ulp is 2e-6
COMMON_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.5,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=None,
)
GEMMA2_3 = dict(
    head_dim=8, query_pre_attn_scalar=8, sliding_window=3, final_logit_softcapping=5.0, attn_logit_softcapping=10.0
)
FALCON_H1 = dict(
    head_dim=8,
    mamba_d_ssm=32,
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_d_state=8,
    mamba_chunk_size=4,
    lm_head_multiplier=0.5,
    embedding_multiplier=2.0,
    mlp_multipliers=[0.5, 2.0],
    key_multiplier=0.7,
    attention_in_multiplier=0.8,
    attention_out_multiplier=1.5,
    ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9],
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.8,
)
# name: (config class, causal LM class, config values beyond COMMON_CONFIG)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=3)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", GEMMA2_3),
    "gemma3-text": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA2_3),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    "gpt-neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(logits_scaling=4.0, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2),
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.25, use_qk_norm=True)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2)),  # the 2nd layer has no rotary
    "falcon-h1": ("FalconH1Config", "FalconH1ForCausalLM", FALCON_H1),
    "falcon": ("FalconConfig", "FalconForCausalLM", {}),  # Falcon-7B's layout: multi-query, rotary, parallel blocks
    "falcon-alibi": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(  # Falcon-RW's layout
            alibi=True, multi_query=False, parallel_attn=False, bias=True
        ),
    ),
}


def build(name):
    """The architecture's tiny random model, in eval mode; the same weights every time."""
    config_name, model_name, overrides = ARCHITECTURES[name]
    config = getattr(transformers, config_name)(**{**COMMON_CONFIG, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch(request, tmp_path_factory):
    """(name, the model in eval mode, the folder it is saved in), built once per architecture."""
    model = build(request.param)
    folder = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(folder)
    return request.param, model, folder


def ragged_batch():
    """Prompts of 4, 2 and 1 tokens left-padded to 4, then 5 completion tokens; the second ends with EOS at its
    third token, followed by padding (as generate() leaves it) that the completion mask hides."""
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    prompt_ids = torch.randint(2, VOCAB, (3, 4), generator=g) * prompt_mask
    completion_ids = torch.randint(2, VOCAB, (3, 5), generator=g) * completion_mask
    completion_ids[1, 2] = EOS
    return torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), completion_mask


def row_by_row(forward, input_ids, attention_mask, completion_mask):
    """forward(ids [1, L]) -> [1, L, ...] on each row's real tokens alone, no padding anywhere; returns its output
    at the position before each real completion token, [B, T, ...] (zeros where masked)."""
    B, T = completion_mask.shape
    rows = []
    for b in range(B):
        real = attention_mask[b].bool()
        out = forward(input_ids[b, real][None])[0]  # [L_b, ...]
        before = attention_mask[b].cumsum(0)[-T:] - 2  # index among the real tokens of the one before each token
        rows.append(torch.stack([out[i] * m for i, m in zip(before, completion_mask[b])]))
    return torch.stack(rows)


def next_token_logprobs(logits, input_ids, completion_mask):
    """log_softmax(logits / temp) picked at the completion tokens, and the entropy; logits [B, T, V] predict them."""
    logprobs = F.log_softmax(logits / TEMPERATURE, dim=-1)
    labels = input_ids[:, -completion_mask.shape[1] :]
    logp = logprobs.gather(-1, labels[..., None]).squeeze(-1) * completion_mask
    entropy = -(logprobs.exp() * logprobs).sum(-1) * completion_mask
    return logp, entropy


@torch.no_grad()
def test_logprobs_match_each_row_alone(arch):
    _, model, _ = arch
    input_ids, attention_mask, completion_mask = ragged_batch()
    logp, entropy = common.token_logprobs(
        model, input_ids, attention_mask, completion_mask, TEMPERATURE, return_entropy=True
    )

    alone = row_by_row(lambda ids: model(ids).logits, input_ids, attention_mask, completion_mask)  # [B, T, V]
    expected_logp, expected_entropy = next_token_logprobs(alone, input_ids, completion_mask)
    torch.testing.assert_close(logp, expected_logp, **CLOSE)
    torch.testing.assert_close(entropy, expected_entropy, **CLOSE)

    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    batched_logp, _ = next_token_logprobs(logits[:, -completion_mask.shape[1] - 1 : -1], input_ids, completion_mask)
    torch.testing.assert_close(logp, batched_logp, **CLOSE)
    assert (logp[completion_mask == 0] == 0).all() and (entropy[completion_mask == 0] == 0).all()


@torch.no_grad()
def test_a_prompt_shared_by_a_group_matches_each_row_alone(arch):
    """GRPO's layout, each prompt twice with another completion: the prompt computed once (prompt_cache.py, where
    the architecture's cache allows it) gives what each row fed alone gives."""
    from machinery import prompt_cache

    name, model, _ = arch
    input_ids, attention_mask, completion_mask = ragged_batch()
    rows = torch.tensor([0, 0, 1, 1, 2, 2])
    input_ids, attention_mask, completion_mask = input_ids[rows], attention_mask[rows], completion_mask[rows]
    input_ids[1::2, -5:] = input_ids[1::2, -5:].flip(1) * completion_mask[1::2]  # the second of each pair its own
    logp = common.token_logprobs(model, input_ids, attention_mask, completion_mask, TEMPERATURE)
    alone = row_by_row(lambda ids: model(ids).logits, input_ids, attention_mask, completion_mask)
    torch.testing.assert_close(logp, next_token_logprobs(alone, input_ids, completion_mask)[0], **CLOSE)
    positions = common.position_ids_from_mask(attention_mask)
    shared = prompt_cache.shared_prompt_cache(model, input_ids, attention_mask, positions, 4)
    assert (shared is None) == (name == "falcon-h1")  # its Mamba layers' state is no plain cache: the plain forward


@torch.no_grad()
def test_positions_must_be_passed():
    """Guards the docstring's claim: without position_ids, GPT-2's left-padded rows come out wrong."""
    model = build("gpt2")
    input_ids, attention_mask, completion_mask = ragged_batch()
    logits = model(input_ids, attention_mask=attention_mask).logits[:, -completion_mask.shape[1] - 1 : -1]
    without_positions, _ = next_token_logprobs(logits, input_ids, completion_mask)
    expected = common.token_logprobs(model, input_ids, attention_mask, completion_mask, TEMPERATURE)
    assert (without_positions - expected).abs().max() > 0.1


LOGIT_TRANSFORMS = ["granite", "cohere", "gemma2", "gemma3-text", "falcon-h1"]


@pytest.mark.parametrize("name", LOGIT_TRANSFORMS)
@torch.no_grad()
def test_logit_transforms_matter(name):
    """Guards the comparisons above: the plain head on the last hidden state gives other log-probs, so a
    token_logprobs that applied the head itself, skipping the transform, would fail them."""
    model = build(name)
    input_ids, attention_mask, completion_mask = ragged_batch()
    T = completion_mask.shape[1]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, output_hidden_states=True)
    plain, _ = next_token_logprobs(model.lm_head(out.hidden_states[-1])[:, -T - 1 : -1], input_ids, completion_mask)
    expected, _ = next_token_logprobs(out.logits[:, -T - 1 : -1], input_ids, completion_mask)
    assert (plain - expected).abs().max() > 0.1


@pytest.mark.exact
@torch.no_grad()
def test_critic_values_match_each_row_alone(arch):
    _, model, folder = arch
    critic = ppo.load_critic(folder, CPU)
    lm_backbone = model.base_model.state_dict()
    for key, weight in critic.backbone.state_dict().items():  # the LM's weights, not a fresh init
        torch.testing.assert_close(weight, lm_backbone[key], atol=0, rtol=0, msg=key)
    input_ids, attention_mask, completion_mask = ragged_batch()
    values = ppo.token_values(critic, input_ids, attention_mask, completion_mask)
    assert values.shape == completion_mask.shape and (values == 0).all()

    torch.manual_seed(1)
    torch.nn.init.normal_(critic.value_head.weight)
    torch.nn.init.normal_(critic.value_head.bias)
    values = ppo.token_values(critic, input_ids, attention_mask, completion_mask)
    hidden = row_by_row(lambda ids: critic.backbone(ids).last_hidden_state, input_ids, attention_mask, completion_mask)
    expected = critic.value_head(hidden).squeeze(-1) * completion_mask  # [B, T]
    torch.testing.assert_close(values, expected, **CLOSE)
    assert expected.abs().max() > 0.1  # a random head gives values far from 0


@torch.no_grad()
def test_reloaded_model_gives_the_same_logprobs(arch):
    _, model, folder = arch
    input_ids, attention_mask, completion_mask = ragged_batch()
    reloaded = models.load_causal_lm(folder, CPU).eval()
    logp = common.token_logprobs(reloaded, input_ids, attention_mask, completion_mask, TEMPERATURE)
    expected = common.token_logprobs(model, input_ids, attention_mask, completion_mask, TEMPERATURE)
    torch.testing.assert_close(logp, expected, atol=1e-6, rtol=0)


def test_gradient_reaches_every_parameter(arch):
    _, model, folder = arch
    input_ids, attention_mask, completion_mask = ragged_batch()
    policy = models.load_causal_lm(folder, CPU).train()  # as the update loop runs it
    with torch.enable_grad():
        logp = common.token_logprobs(policy, input_ids, attention_mask, completion_mask, TEMPERATURE)
        logp.sum().backward()
    with torch.no_grad():
        expected = common.token_logprobs(model, input_ids, attention_mask, completion_mask, TEMPERATURE)
    torch.testing.assert_close(logp.detach(), expected, **CLOSE)  # dropout is off
    for key, param in policy.named_parameters():
        assert param.grad is not None and param.grad.isfinite().all(), key
    assert sum(param.grad.abs().sum() for param in policy.parameters()) > 0
