"""Per-document SDPA on packed rows against transformers' own eager attention with its block mask."""

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardline.data.loader import make_batch
from shardline.data.packing import Document, pack
from shardline.model.build import build_model
from shardline.model.document_attention import LENGTH_BUCKET, NAME
from shardline.model.flops import count_params
from shardline.spec.resolve import load_spec
from shardline.training.loss import token_loss_sum
from tests.tiers import needs_gpu

VOCAB, SEQ = 256, 64


def _model(attn: str):
    spec = load_spec("tiny", [f"model.arch.vocab_size={VOCAB}", "model.arch.hidden_size=64",
                              "model.arch.intermediate_size=128", "model.arch.num_layers=2", "model.arch.num_heads=4",
                              "model.arch.num_kv_heads=2", f"model.attn_implementation={attn}"])
    return build_model(spec.model, VOCAB, {}), spec.model.arch


def _rows(lengths: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    docs = [Document(ids=rng.integers(3, VOCAB, n).tolist(), n_prompt=n // 2) for n in lengths]
    return pack(docs, SEQ, pad_id=0)


def _assert_same_logits_and_gradients(model, batch, keywords: dict) -> None:
    """The model's logits and every gradient with `keywords` passed equal those of the per-document buckets."""
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids,
              **batch.spans.model_kwargs(torch.device("cpu"))}
    results = []
    for extra in ({}, keywords):
        model.zero_grad()
        logits = model(**inputs, **extra).logits
        logits.float().pow(2).mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (buckets, bucket_grads), (other, other_grads) = results
    torch.testing.assert_close(other, buckets, atol=1e-5, rtol=1e-4)
    for got, expected in zip(other_grads, bucket_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_sdpa_means_per_document_sdpa_and_matches_eager_with_the_block_mask_in_loss_and_gradients():
    ours, _ = _model("sdpa")
    eager, _ = _model("eager")
    assert ours.config._attn_implementation == NAME
    rows = _rows([40, 24, 17, 30, 64, 5, 9, 33])  # documents of every size, padding tails, a full row
    batch = make_batch(rows, np.arange(len(rows.n_real)))
    assert len(batch.spans.lengths) > len(rows.n_real)  # several documents per row
    loss_ours, loss_eager = token_loss_sum(ours, batch), token_loss_sum(eager, batch)
    assert loss_ours.item() == pytest.approx(loss_eager.item(), rel=1e-5)
    loss_ours.backward()
    loss_eager.backward()
    for (name, a), b in zip(ours.named_parameters(), eager.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name
    # Without spans (generation, padded evaluation) it is plain SDPA: same logits as eager with a padding mask.
    ids = torch.randint(3, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = eager(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(a[mask.bool()], b[mask.bool()], atol=1e-5)


def test_attention_work_is_the_sum_of_squared_document_lengths_not_the_row_length_squared():
    ours, a = _model("sdpa")
    rows = _rows([16, 16, 32, 8, 24, 32, 20, 12, 32])  # fills rows exactly: no padding
    batch = make_batch(rows, np.arange(len(rows.n_real)))
    assert all(batch.spans.real) and batch.n_tokens == batch.input_ids.numel()
    # The math backend is plain matmuls the counter sees (it has no formula for the CPU flash kernel).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        token_loss_sum(ours, batch).backward()
    counts = count_params(ours)
    # Each span is rounded up to LENGTH_BUCKET tokens (equal lengths batch; one CPU kernel per length).
    executed = sum((-(-n // LENGTH_BUCKET) * LENGTH_BUCKET) ** 2 for n in batch.spans.lengths)
    expected = 6 * counts.trainable * batch.n_tokens + 12 * a.num_layers * a.hidden_size * executed
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.02)
    assert batch.spans.pairs < executed
    assert batch.spans.executed_causal_pairs(LENGTH_BUCKET) == pytest.approx(executed / 2, rel=0.05)


def test_cpu_memory_stays_flat_when_every_step_brings_new_document_lengths():
    """bf16 CPU SDPA keeps one kernel per sequence length: raw lengths grew RSS by ~3 MB per new length."""
    ours, _ = _model("sdpa")
    ours = ours.to(torch.bfloat16)

    def hwm() -> int:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024

    def steps(lengths):
        for start in range(0, len(lengths), 8):
            rows = _rows(lengths[start:start + 8], seed=start)
            token_loss_sum(ours, make_batch(rows, np.arange(len(rows.n_real)))).backward()

    # One document per row, 8 rows per batch (the matmuls see one shape); documents round up to 64 tokens,
    # padding tails (64 - len) to 32.
    steps(list(range(33, 41)) * 2)
    before = hwm()
    steps(list(range(41, 64)) + list(range(41, 50)))  # 23 lengths never seen, all in seen buckets
    assert hwm() - before < 20 * 2**20


def test_a_batch_builds_its_span_indices_once_for_every_layer_and_the_backward():
    from shardline.model.document_attention import _plan

    ours, a = _model("sdpa")
    batch = make_batch(_rows([40, 24, 17, 30, 64, 5, 9, 33], seed=3), np.arange(4))
    _plan.cache_clear()
    token_loss_sum(ours, batch).backward()
    info = _plan.cache_info()
    assert (info.misses, info.hits) == (1, a.num_layers - 1)


@needs_gpu("device synchronisation is GPU-only")
@pytest.mark.parametrize("lengths", [[40, 24, 17, 30, 64, 5, 9, 33, 34],  # crossing rows: the buckets
                                     [40, 24, 17, 30, 17, 64, 5, 9, 33, 17]])  # row by row: the dense mask
def test_on_a_gpu_packed_attention_never_waits_for_the_device(lengths):
    # Found on an H100: the span indices were built per bucket per layer on the device (boolean masks, pageable
    # copies), each a wait for the GPU, dozens a step. (transformers' own packed-sequence check in the model's
    # forward also synchronises once per forward; this checks shardline's attention function alone.)
    from shardline.model.document_attention import document_sdpa

    cu = torch.tensor([0, *lengths]).cumsum(0)
    q, k, v = (torch.randn(4, heads, SEQ, 16, device="cuda", requires_grad=True) for heads in (4, 2, 2))
    module = torch.nn.Module()
    for attempt in ("warm-up", "checked"):  # the first call may load kernels
        if attempt == "checked":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out, _ = document_sdpa(module, q, k, v, None, scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
            out.sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert out.shape == (4, SEQ, 4, 16)


def test_on_a_gpu_short_buckets_never_pay_cudnns_host_cost_and_long_ones_may():
    from shardline.model.document_attention import CUDNN_MIN_SPAN, sdpa_backends

    assert sdpa_backends(CUDNN_MIN_SPAN, torch.device("cpu")) is None  # CPU: SDPA's own choice
    assert sdpa_backends(64, torch.device("cpu")) is None
    assert SDPBackend.CUDNN_ATTENTION not in sdpa_backends(CUDNN_MIN_SPAN - 1, torch.device("cuda"))
    assert sdpa_backends(CUDNN_MIN_SPAN, torch.device("cuda")) is None


@pytest.mark.parametrize("window", [None, 12])
def test_short_rows_on_a_gpu_take_one_masked_call_equal_to_the_per_document_buckets(window):
    # On CUDA, rows of at most DENSE_MAX_SEQ tokens run as whole rows with the block-diagonal mask; the same
    # function computes it here on the CPU and must equal the buckets in output and gradients.
    from shardline.model.document_attention import DENSE_MAX_SEQ, _block_mask, _dense, _per_document, uses_dense_mask

    assert uses_dense_mask(DENSE_MAX_SEQ, torch.device("cuda")) and not uses_dense_mask(64, torch.device("cpu"))
    assert not uses_dense_mask(DENSE_MAX_SEQ + 1, torch.device("cuda"))
    lengths = (40, 24, 17, 30, 17, 64, 5, 9, 33, 17)  # 4 rows of 64, no document crossing a row
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, heads, SEQ, 16, dtype=torch.float64, requires_grad=True) for heads in (4, 2, 2))
    grads = []
    for path in ("buckets", "dense"):
        if path == "dense":
            mask = _block_mask(lengths, 4, SEQ, torch.device("cpu"), window)
            out = _dense(q, k, v, mask, 0.25, True)
        else:
            out = _per_document(q, k, v, lengths, 0.25, True, window)
        grads.append((out, *torch.autograd.grad(out.pow(2).sum(), (q, k, v))))
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs)
    # a document crossing a row boundary has no per-row mask: the buckets stay
    assert _block_mask((40, 24, 17, 30, 64, 5, 9, 33, 34), 4, SEQ, torch.device("cpu")) is None


@needs_gpu("which SDPA kernel runs is GPU-only")
def test_on_a_gpu_packed_attention_runs_no_cudnn_kernel_on_short_documents():
    # Found on an H200: cuDNN's SDPA cost ~1.4 ms of host time per bucketed call, and shardline's step ran 2x HF
    # Trainer's on the same rows with the GPU idle behind the host.
    from torch.profiler import ProfilerActivity, profile

    from shardline.model.document_attention import document_sdpa

    lengths = [40, 24, 17, 30, 64, 5, 9, 33, 34]
    lengths = [n * 32 for n in lengths]  # rows of 2048 tokens: longer than DENSE_MAX_SEQ, so the buckets run
    cu = torch.tensor([0, *lengths]).cumsum(0)
    q, k, v = (torch.randn(4, heads, SEQ * 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (4, 2, 2))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out, _ = document_sdpa(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        out.float().sum().backward()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert not [n for n in names if "cudnn_attention" in n], sorted(names)
    assert [n for n in names if "flash_attention" in n or "efficient_attention" in n], sorted(names)


def _each_document_alone(q, k, v, lengths, window):
    """fp32 causal SDPA on each document of the flattened rows by itself (banded by `window`); [B, T, H, D]."""
    import torch.nn.functional as F

    b, h, t, d = q.shape
    flat = [x.float().transpose(0, 1).reshape(x.shape[1], b * t, d) for x in (q, k, v)]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[:, start:start + n].unsqueeze(0) for x in flat)
        i = torch.arange(n, device=q.device)
        keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < (window or n))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=keep, enable_gqa=True)[0])
        start += n
    return torch.cat(outs, 1).reshape(h, b, t, d).permute(1, 2, 0, 3)


def test_the_variable_length_flash_kernel_is_there_for_the_gpu_path_and_only_cuda_half_precision_takes_it():
    # the pinned torch has the op with a window (torch 2.10's took is_causal only: the buckets stay there)
    from shardline.model.document_attention import _varlen_kernel, uses_varlen

    assert _varlen_kernel() is not None
    assert not uses_varlen(torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16))  # CPU: the buckets
    if torch.cuda.is_available():
        assert uses_varlen(torch.zeros(1, 2, 4, 16, dtype=torch.bfloat16, device="cuda"))
        assert not uses_varlen(torch.zeros(1, 2, 4, 16, device="cuda"))  # fp32: flash has no kernel


@needs_gpu("the variable-length flash kernel is CUDA-only")
@pytest.mark.parametrize("window", [None, 300])
def test_on_a_gpu_long_packed_rows_run_one_varlen_flash_call_equal_to_each_document_alone(window, monkeypatch):
    from shardline.model import document_attention

    calls = []
    varlen = document_attention._varlen
    monkeypatch.setattr(document_attention, "_varlen", lambda *a, **kw: calls.append(1) or varlen(*a, **kw))
    torch.manual_seed(0)
    module = torch.nn.Module()
    for attempt, lengths in (("warm-up", [40, 24, 17, 30, 64, 5, 9, 33, 34]),  # crossing rows
                             ("checked", [40, 24, 17, 30, 17, 64, 5, 9, 33, 17])):
        lengths = [n * 32 for n in lengths]  # rows of 2048 tokens: longer than DENSE_MAX_SEQ
        cu = torch.tensor([0, *lengths]).cumsum(0)
        q, k, v = (torch.randn(4, heads, SEQ * 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for heads in (8, 2, 2))
        cotangent = torch.randn(4, SEQ * 32, 8, 64, device="cuda")
        torch.cuda.synchronize()
        if attempt == "checked":  # new lengths: the offsets' copy too must not wait for the device
            torch.cuda.set_sync_debug_mode("error")
        try:
            out, _ = document_attention.document_sdpa(module, q, k, v, None, scaling=0.125, cu_seq_lens_q=cu,
                                                      cu_seq_lens_k=cu, sliding_window=window)
            grads = torch.autograd.grad((out.float() * cotangent).sum(), (q, k, v))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
        expected = _each_document_alone(*leaves, lengths, window)
        expected_grads = torch.autograd.grad((expected * cotangent).sum(), leaves)
        for got, want in zip((out, *grads), (expected, *expected_grads), strict=True):
            assert got.shape == want.shape
            assert ((got.float() - want).norm() / want.norm()).item() < 1e-2  # bf16 against fp32
    assert len(calls) == 2


def _mistral(attn: str, window: int):
    from transformers import MistralConfig, MistralForCausalLM

    from shardline.model.document_attention import register

    register()
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                           sliding_window=window, attn_implementation=attn)
    torch.manual_seed(0)
    return MistralForCausalLM(config).float()


def _one_document_at_a_time(model, batch) -> float:
    """transformers' own summed loss over the batch's documents, each run alone (no packing, no mask of ours)."""
    import torch.nn.functional as F

    total = 0.0
    for r in range(batch.input_ids.shape[0]):
        positions = batch.position_ids[r].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for a, b in zip(starts, starts[1:], strict=False):
            labels = batch.labels[r:r + 1, a:b]
            if (labels != -100).any():
                with torch.no_grad():
                    logits = model(input_ids=batch.input_ids[r:r + 1, a:b]).logits
                total += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                         reduction="sum").item()
    return total


def test_a_sliding_window_is_honoured_in_packed_rows_as_transformers_computes_it():
    # was: Mistral's window silently ignored, the same first loss with sliding_window 8 and 4096
    rows = _rows([40, 24, 17, 30, 64, 5, 9, 33], seed=7)  # documents longer and shorter than the window
    batch = make_batch(rows, np.arange(len(rows.n_real)))
    windowed, wide = _mistral(NAME, 8), _mistral(NAME, 4096)
    loss_windowed = token_loss_sum(windowed, batch).item()
    assert loss_windowed != pytest.approx(token_loss_sum(wide, batch).item(), rel=1e-4)
    # the oracle: transformers' eager Mistral on each document alone (its packed-row mask with a window read
    # 630.2466 here against 630.1452 one document at a time, so packed eager is not used as the reference)
    assert loss_windowed == pytest.approx(_one_document_at_a_time(_mistral("eager", 8), batch), rel=1e-5)
    assert token_loss_sum(wide, batch).item() == pytest.approx(
        _one_document_at_a_time(_mistral("eager", 4096), batch), rel=1e-5)


def test_attention_sinks_are_refused_by_name_not_dropped():
    from shardline.errors import SpecError
    from shardline.model.document_attention import document_sdpa

    cu = torch.tensor([0, 10, 16])
    q = k = v = torch.randn(1, 2, 16, 8)
    with pytest.raises(SpecError, match="attention sinks") as e:
        document_sdpa(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu, s_aux=torch.zeros(2))
    assert e.value.where == "model.attn_implementation"


def test_masks_built_before_the_forward_keep_the_buckets_loss_and_a_compiled_block_whole():
    """On CUDA, short rows run the dense path; its masks come to the model built before the forward, so the attention
    reads no span offsets on the host and a compiled block (`parallel.compile`) is one graph. Here the same masks
    on the CPU: the loss and gradients equal the per-document buckets', and dynamo compiles each block without a
    graph break, where the buckets' path breaks it at every layer."""
    from torch._dynamo.utils import counters

    from shardline.data.spans import DocumentSpans
    from shardline.model.document_attention import DENSE_MASKS, dense_masks
    from shardline.model.families import layer_windows

    ours, arch = _model("sdpa")
    batch = make_batch(_rows([40, 24, 17, 30, 17, 64, 5, 9, 33, 17], seed=5), np.arange(4))
    rows, seq = batch.input_ids.shape
    masks = dense_masks(batch.spans, rows, seq, torch.device("cpu"), layer_windows(ours.config))
    assert masks is not None and set(masks) == {0}
    _assert_same_logits_and_gradients(ours, batch, {DENSE_MASKS: masks})
    inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids,
              **batch.spans.model_kwargs(torch.device("cpu"))}

    for layer in ours.model.layers:
        layer.compile(backend="eager")  # dynamo's graphs and breaks, without inductor's codegen
    breaks = {}
    for path in ("dense", "buckets"):
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            ours(**inputs, **({DENSE_MASKS: masks} if path == "dense" else {}))
        breaks[path] = sum(counters["graph_break"].values())
    assert breaks["dense"] == 0 and breaks["buckets"] >= arch.num_layers, breaks
    crossing = (40, 24, 17, 30, 64, 5, 9, 33, 34)  # a document crosses a row boundary: the buckets stay
    spans = DocumentSpans(torch.tensor([0, *crossing]).cumsum(0).int(), crossing, (True,) * len(crossing))
    assert dense_masks(spans, rows, seq, torch.device("cpu"), (None,)) is None


def test_rows_of_one_document_each_run_plain_causal_sdpa_equal_to_the_buckets_and_a_compiled_block_whole():
    """Rows that each hold one whole document (pre-training style data, the peers' protocols) need no mask and no
    span offsets: `token_loss_sum` passes `WHOLE_ROWS` and each layer runs one causal SDPA call over the rows. The
    loss and gradients equal the per-document buckets', and dynamo compiles each block without a graph break."""
    from torch._dynamo.utils import counters

    from shardline.model.document_attention import WHOLE_ROWS, whole_rows

    ours, arch = _model("sdpa")
    batch = make_batch(_rows([SEQ] * 4, seed=7), np.arange(4))
    rows, seq = batch.input_ids.shape
    assert (rows, seq) == (4, SEQ) and whole_rows(batch.spans, rows)
    padded = make_batch(_rows([SEQ - 4, SEQ, SEQ, SEQ], seed=7), np.arange(4))  # a padding tail is a span
    packed = make_batch(_rows([40, 24, SEQ, SEQ, SEQ], seed=7), np.arange(4))  # a row of two documents
    assert not whole_rows(padded.spans, 4) and not whole_rows(packed.spans, 4)
    _assert_same_logits_and_gradients(ours, batch, {WHOLE_ROWS: True})

    for layer in ours.model.layers:
        layer.compile(backend="eager")  # dynamo's graphs and breaks, without inductor's codegen
    breaks = {}
    for path, data in (("rows", batch), ("packed", packed)):
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            loss = token_loss_sum(ours, data)  # the trainer's forward: it passes WHOLE_ROWS where it holds
        breaks[path] = sum(counters["graph_break"].values())
        assert torch.isfinite(loss)
    assert breaks["rows"] == 0 and breaks["packed"] >= arch.num_layers, breaks


def test_attention_dropout_on_packed_rows_masks_documents_as_transformers_does():
    """With spans the model gets a placeholder mask and transformers builds none (no packed-sequence check on the
    host, no [B, 1, T, T] mask per forward); attention dropout, the one path that needs a mask, builds the same
    block-diagonal mask itself. Same weights, same seed: the loss equals transformers' own SDPA path, which finds the
    documents from the positions, and differs from the loss without dropout."""
    import copy

    import torch.nn.functional as F

    ours, _ = _model("sdpa")
    theirs = copy.deepcopy(ours)
    theirs.set_attn_implementation("sdpa")
    for model in (ours, theirs):
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.25
        model.train()
    batch = make_batch(_rows([40, 24, 17, 30, 17, 64, 5, 9, 33, 17], seed=5), np.arange(4))
    losses = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        torch.manual_seed(3)
        if name == "ours":
            losses[name] = token_loss_sum(model, batch)
        else:
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
            losses[name] = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(), reduction="sum")
    torch.testing.assert_close(losses["ours"], losses["theirs"], atol=1e-4, rtol=1e-5)
    ours.eval()
    assert abs(token_loss_sum(ours, batch).item() - losses["ours"].item()) > 1e-3  # the dropout acted


def test_where_short_rows_take_dense_masks_whole_document_rows_build_none(monkeypatch):
    """On CUDA, rows of ≤ 1024 tokens get block-diagonal masks built before the forward; rows of one whole document
    need none (one causal call per row), unless a layer's window is shorter than the row. The device rule is
    forced here; the masks the forward would get are recorded."""
    from shardline.training import loss

    built = []
    monkeypatch.setattr(loss, "uses_dense_mask", lambda seq, device: True)
    monkeypatch.setattr(loss, "dense_masks", lambda *args: built.append(args) or None)
    ours, _ = _model("sdpa")
    whole = make_batch(_rows([SEQ] * 4, seed=7), np.arange(4))
    packed = make_batch(_rows([40, 24, 17, 30, 17, 64, 5, 9, 33, 17], seed=5), np.arange(4))
    with torch.no_grad():
        token_loss_sum(ours, whole)
        assert built == []
        token_loss_sum(ours, packed)
        assert len(built) == 1
        ours.config.sliding_window = SEQ // 2  # as Mistral's: each layer's window (layer_windows) now cuts the row
        ours.config.layer_types = ["sliding_attention"] * len(ours.model.layers)
        token_loss_sum(ours, whole)
    assert len(built) == 2 and built[1][-1] == (SEQ // 2,) * len(ours.model.layers)
