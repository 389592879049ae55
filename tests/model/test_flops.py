import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardline.data.spans import window_causal_pairs, window_pairs
from shardline.model.build import build_model
from shardline.model.document_attention import window_mask
from shardline.model.families import layer_windows
from shardline.model.flops import count_params, flops_per_token, table_peak_tflops
from shardline.model.lora import apply_lora
from shardline.spec.resolve import load_spec
from tests.model.families import COMMON, CONFIGS, FAMILIES

SEQ = 64


def _tiny(*overrides):
    spec = load_spec("tiny", ["model.arch.vocab_size=512", "model.arch.hidden_size=64",
                              "model.arch.intermediate_size=160", "model.arch.num_layers=2",
                              "model.arch.num_heads=4", "model.arch.num_kv_heads=2",
                              "model.attn_implementation=eager", *overrides])  # counted matmuls
    model = build_model(spec.model, 512, {})
    if spec.model.lora.enabled:
        model = apply_lora(model, spec.model.lora)
    return model, spec.model.arch


def test_param_count_matches_a_hand_count():
    model, a = _tiny()
    d, f, v, L = a.hidden_size, a.intermediate_size, a.vocab_size, a.num_layers
    kv = d // a.num_heads * a.num_kv_heads
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d  # q, k+v, o, gate/up/down, two norms
    counts = count_params(model)
    assert counts.embedding == v * d
    assert counts.trainable == L * per_layer + d + v * d  # + final norm + lm_head
    assert counts.frozen == 0
    expected = 6 * counts.trainable + 12 * L * d * SEQ
    assert flops_per_token(counts, L, d, SEQ) == expected


def _measured_flops_per_token(model, batch=2):
    ids = torch.randint(0, 512, (batch, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.float().sum().backward()
    return counter.get_total_flops() / (batch * SEQ)


def test_formula_matches_counted_matmul_flops_of_forward_and_backward():
    model, a = _tiny()
    formula = flops_per_token(count_params(model), a.num_layers, a.hidden_size, SEQ)
    assert _measured_flops_per_token(model) == pytest.approx(formula, rel=0.02)


def test_lora_counts_frozen_weights_at_four_flops_per_parameter():
    model, a = _tiny("model.lora.enabled=true", "model.lora.r=4")
    counts = count_params(model)
    kv = 64 // 4 * 2
    per_layer = 4 * ((64 + 64) + (64 + kv) + (64 + kv) + (64 + 64))  # r·(in+out) for q, k, v, o
    assert counts.trainable == a.num_layers * per_layer
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    formula = flops_per_token(counts, a.num_layers, a.hidden_size, SEQ)
    # The counter sees the real backward: no weight gradients for frozen matrices.
    assert _measured_flops_per_token(model) == pytest.approx(formula, rel=0.05)
    assert formula < 0.8 * flops_per_token(type(counts)(counts.total - counts.embedding, 0, counts.embedding),
                                           a.num_layers, a.hidden_size, SEQ)


@pytest.mark.parametrize("name", FAMILIES)
def test_formula_matches_counted_flops_for_every_family(name):
    """Attention width heads × head_dim (Qwen3: 128 ≠ hidden 64), fused projections, biases, four norms; a mixture's
    active experts (top-k of E: its eager experts compute only the routed tokens, which the counter sees; torch's
    grouped mm, the CPU default, is not counted by FlopCounterMode)."""
    from transformers import AutoModelForCausalLM

    cls, extra = CONFIGS[name]
    config = cls(**COMMON, **extra, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    eager = {"experts_implementation": "eager"} if name.endswith("_moe") else {}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **eager)  # counted matmuls
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or 64 // config.num_attention_heads)
    # eager attention computes every pair, windowed layers too: the formula without windows is what it runs
    formula = flops_per_token(count_params(model), config.num_hidden_layers, width, SEQ)
    assert _measured_flops_per_token(model) == pytest.approx(formula, rel=0.02)
    if windows := layer_windows(config) if any(layer_windows(config)) else ():
        assert flops_per_token(count_params(model), config.num_hidden_layers, width, SEQ, windows) < formula


def test_sliding_window_pairs_count_the_band_the_window_mask_keeps():
    for n, w in [(10, 4), (64, 16), (5, 8), (16, 16), (1, 3)]:
        band = window_mask(n, w)
        assert window_causal_pairs(n, w) == int(band.sum())
        assert window_pairs(n, w) == int((band | band.T).sum())
    assert window_pairs(10, None) == 100 and window_causal_pairs(10, None) == 55


@pytest.mark.parametrize(("name", "dtype", "peak"), [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.0),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
    ("NVIDIA H200", torch.bfloat16, 989.0),
    ("NVIDIA B200", torch.bfloat16, 2250.0),
    ("NVIDIA A100-SXM4-80GB", torch.float32, 156.0),
    ("NVIDIA L40S", torch.bfloat16, 362.0),  # not the L4's 121
    ("Tesla T4", torch.bfloat16, None),  # no bf16 tensor cores: the trainer measures instead
    ("Some Future GPU", torch.bfloat16, None),
])
def test_peak_table(name, dtype, peak):
    assert table_peak_tflops(name, dtype) == peak
