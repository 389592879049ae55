"""The chunked cross-entropy equals the whole-logits loss (and transformers' own) in value and in every gradient."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from shardline.data.loader import IGNORE_INDEX, make_batch
from shardline.data.packing import Document, pack
from shardline.model.lora import apply_lora
from shardline.spec import LoraSpec
from shardline.training.chunked_loss import chunked_cross_entropy_sum
from shardline.training.loss import takes_chunked_loss, token_loss_sum
from tests.conftest import REPO
from tests.model.families import COMMON, CONFIGS

WORKER = Path(__file__).with_name("chunked_loss_worker.py")

SEQ = 64


def _model(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


def _batch(vocab: int):
    """Packed rows of prompt-masked documents (half of each is prompt) with padding tails."""
    rng = np.random.default_rng(0)
    docs = [Document(ids=rng.integers(3, vocab, n).tolist(), n_prompt=n // 2) for n in (40, 24, 17, 30, 64, 9, 33)]
    rows = pack(docs, SEQ, pad_id=0)
    return make_batch(rows, np.arange(len(rows.n_real)))


# fp32 (unit roundoff u = 6e-8), whatever the CPU class: the chunked sum adds up to ~40 chunk sums in sequence and
# runs GEMMs of M = 7..50 rows where the whole logits run one of M = N, each with its own blocking, so the two losses
# differ by up to (log2 N + chunks)·u ≈ 3e-6 relative; a dropped or mis-scaled chunk is ≥ 1e-2.
LOSS_RTOL = 5e-6
GRAD_RTOL = 1e-5
"""Of the tensor's largest entry: gradients sum ~N products in another order, ≲ u·√N·max|g|·(a few)."""

def _loss_and_grads(model, batch, chunk):
    model.zero_grad(set_to_none=True)
    loss = token_loss_sum(model, batch, chunk)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_chunked_equals_full(model, batch, chunks):
    full, full_grads = _loss_and_grads(model, batch, None)
    assert 0 < batch.n_loss_tokens < batch.labels.numel()
    for chunk in chunks:
        loss, grads = _loss_and_grads(model, batch, chunk)
        assert loss.item() == pytest.approx(full.item(), rel=LOSS_RTOL), chunk
        assert grads.keys() == full_grads.keys()
        for name, g in grads.items():
            ref = full_grads[name]
            assert (g - ref).abs().max() <= GRAD_RTOL * ref.abs().max(), f"{name}, chunk {chunk}"


def test_chunked_loss_and_gradients_equal_the_whole_logits_for_chunks_that_do_not_divide_the_tokens():
    model = _model(LlamaConfig(**COMMON))
    batch = _batch(COMMON["vocab_size"])
    assert batch.n_loss_tokens % 7 and batch.n_loss_tokens % 50  # chunks that leave a short last chunk
    _assert_chunked_equals_full(model, batch, [7, 50, batch.n_loss_tokens, 4096])
    # transformers' own loss (mean over its shifted labels) on the same logits: the oracle of the oracle
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                labels=torch.cat([batch.input_ids[:, :1], batch.labels], dim=1)[:, :-1])
    assert out.loss.item() * batch.n_loss_tokens == pytest.approx(token_loss_sum(model, batch, 7).item(), rel=LOSS_RTOL)


def test_chunked_loss_with_tied_embeddings_and_with_lora():
    tied = _model(LlamaConfig(**COMMON, tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    batch = _batch(COMMON["vocab_size"])
    _assert_chunked_equals_full(tied, batch, [13, 64])
    lora = apply_lora(_model(LlamaConfig(**COMMON)), LoraSpec(enabled=True, r=4))
    for p in lora.parameters():  # nonzero adapters, so their gradients depend on the head's
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)
    _assert_chunked_equals_full(lora, batch, [13, 64])


def test_chunked_loss_applies_gemma2_final_logit_softcapping():
    cls, extra = CONFIGS["gemma2"]
    model = _model(cls(**COMMON, **extra))
    batch = _batch(COMMON["vocab_size"])
    _assert_chunked_equals_full(model, batch, [11, 100])
    uncapped = token_loss_sum(model, batch, 11).item()
    model.config.final_logit_softcapping = None  # the cap is applied: it changes the loss here
    assert token_loss_sum(model, batch, 11).item() != pytest.approx(uncapped, rel=1e-3)


def test_an_empty_batch_still_reaches_the_head_with_a_zero_gradient():
    head = torch.nn.Linear(8, 16, bias=False)
    hidden = torch.zeros(0, 8, requires_grad=True)
    loss = chunked_cross_entropy_sum(hidden, torch.zeros(0, dtype=torch.long), head, None, 4)
    loss.backward()
    assert loss.item() == 0 and head.weight.grad is not None and not head.weight.grad.any()


def test_only_one_chunk_of_logits_is_saved_for_backward():
    """The knob changes what autograd keeps: chunked, the saved tensors are the chunk inputs, never [N, V]."""
    head = torch.nn.Linear(32, 1000, bias=False)
    hidden = torch.randn(300, 32, requires_grad=True)
    labels = torch.randint(0, 1000, (300,))
    labels[::5] = IGNORE_INDEX

    def saved_elements(chunk):
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            loss = chunked_cross_entropy_sum(hidden, labels, head, None, chunk)
        return max(sizes), loss

    whole, loss_whole = saved_elements(300)
    chunked, loss_chunked = saved_elements(64)
    assert whole >= 300 * 1000 and chunked < 64 * 1000
    assert loss_chunked.item() == pytest.approx(loss_whole.item(), rel=LOSS_RTOL)


def _head_outputs(model: torch.nn.Module, batch, chunk: int | None) -> tuple[float, list[tuple[int, ...]]]:
    """`token_loss_sum`'s value and the shape of every output of the LM head while it ran."""
    shapes: list[tuple[int, ...]] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    try:
        with torch.no_grad():
            return token_loss_sum(model, batch, chunk).item(), shapes
    finally:
        hook.remove()


def test_the_tested_families_take_the_chunked_loss_and_never_hold_the_whole_logits():
    """`train.loss_chunk_tokens` > 0 runs the head on chunks of at most that many loss-bearing tokens for every family
    shardline is tested with: its output is never the whole [B, T, V] (a family silently falling back to the whole
    logits would still compute the same loss). 0 or None: the whole logits."""
    batch = _batch(COMMON["vocab_size"])
    whole_shape = (*batch.input_ids.shape, COMMON["vocab_size"])
    paths = {}
    for name, (cls, extra) in CONFIGS.items():
        model = _model(cls(**COMMON, **extra, pad_token_id=0))  # Phi-3's default pad id is outside the vocabulary
        paths[name] = [takes_chunked_loss(model.config, chunk) for chunk in (16, 0, None)]
        whole, whole_shapes = _head_outputs(model, batch, None)
        assert whole_shapes == [whole_shape], name
        loss, shapes = _head_outputs(model, batch, 16)
        assert len(shapes) == -(-batch.n_loss_tokens // 16), (name, shapes)  # only loss-bearing tokens, 16 at a time
        assert all(len(s) == 2 and s[0] <= 16 for s in shapes), (name, shapes)
        assert loss == pytest.approx(whole, rel=LOSS_RTOL), name
    assert paths == {name: [True, False, False] for name in CONFIGS}


@pytest.mark.slow
def test_two_fsdp_ranks_take_the_same_first_step_chunked_as_with_the_whole_logits(tmp_path):
    """FSDP2 on 2 ranks, the chunk size read from `train.loss_chunk_tokens`: the LM head is the root's, all-gathered
    for the chunked loss and reduce-scattered after; a tied head's gradient (the embedding's too) trains the same."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER),
           str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = torch.load(tmp_path / "results.pt")
    for layout in ("plain", "tied", "tied+lora+ac"):
        (full_loss, full_state, full_rows), (loss, state, rows) = results[(layout, None)], results[(layout, 7)]
        assert rows <= 7 and full_rows >= 64, layout  # chunks of 7 rows, against whole rows of 64 tokens
        assert loss == pytest.approx(full_loss, rel=LOSS_RTOL), layout
        assert state.keys() == full_state.keys() and state
        for name, p in state.items():  # SGD at lr 0.5 moves by 0.5·g, |g| ≲ 1: Δp agrees to 0.5·GRAD_RTOL
            torch.testing.assert_close(p, full_state[name], rtol=0, atol=5e-6, msg=f"{layout}: {name}")
    # the tied head is the embedding: it trains (a gradient the chunked loss dropped would leave it unequal above)
    assert "model.embed_tokens.weight" in results[("tied", 7)][1] and not any(
        "lm_head" in n for n in results[("tied", 7)][1])


def test_a_family_outside_the_tested_ones_keeps_its_whole_logits():
    """Granite scales its logits in its causal LM's forward: the chunked path (a linear head, Gemma 2's cap) would
    drop that, so an untested family's loss comes from its own `.logits`."""
    from transformers import GraniteConfig

    model = _model(GraniteConfig(**COMMON, logits_scaling=4.0))
    batch = _batch(COMMON["vocab_size"])
    assert not takes_chunked_loss(model.config, 16)
    whole, shapes = _head_outputs(model, batch, 16)
    assert shapes == [(*batch.input_ids.shape, COMMON["vocab_size"])]  # the whole logits, by the family's forward
    with torch.no_grad():
        assert token_loss_sum(model, batch).item() == whole
        hidden = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids).last_hidden_state
        unscaled = chunked_cross_entropy_sum(hidden.flatten(0, 1), batch.labels.flatten(), model.lm_head, None, 16)
    assert unscaled.item() != pytest.approx(whole, rel=1e-3)  # the scaling matters here
