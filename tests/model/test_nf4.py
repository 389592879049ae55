"""QLoRA's NF4 base (`shardline.model.nf4`): the weights a run computes with are torchao's NF4 of the whole weight
(on 1 and 2 ranks, from a checkpoint and from the seeded init), the planner counts torchao's storage byte for byte,
and forward and backward run through the NF4 weights into the adapters only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchao.quantization import NF4Tensor, to_nf4  # the reference: torchao itself

from shardline.model.build import build_model
from shardline.model.lora import apply_lora, quantize_frozen_base
from shardline.model.nf4 import is_nf4
from shardline.model.nf4_layout import nf4_bytes
from shardline.planning.memory import nf4_block_weights, param_budget
from shardline.spec import ArchSpec, LoraSpec, ModelSpec
from tests.conftest import REPO
from tests.model.nf4_worker import INNER, fixed_batch
from tests.model.sharded_load_worker import write_checkpoint

WORKER = Path(__file__).with_name("nf4_worker.py")
# hidden 128, MLP 256, 4 heads over 2 key/value heads: q/o (128 × 128) and the MLP (128 × 256) are multiples of
# torchao's 64 × 256 elements, k/v (64 × 128) are not and stay dense
ARCH = ArchSpec(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                max_position_embeddings=256)
LORA = LoraSpec(enabled=True, r=4, quantize_base="nf4")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _reference(spec: ModelSpec, dtype: torch.dtype) -> tuple[dict[str, NF4Tensor], dict[str, torch.Tensor]]:
    """torchao's NF4 of each whole frozen projection weight of the plain model (the checkpoint's, or shardline's
    seeded init), cast to the compute dtype first as the run holds it; and the plain model's weights."""
    plain = build_model(spec.model_copy(update={"lora": LoraSpec()}), 0, {}, device="cpu")
    weights = {n: p.detach() for n, p in plain.named_parameters()}
    projections = {n: w for n, w in weights.items() if ".layers." in n and n.endswith("proj.weight")}
    return {n: to_nf4(w.to(dtype)) for n, w in projections.items() if w.numel() % (64 * 256) == 0}, weights


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "precision", "source"), [(1, "bf16", "checkpoint"), (2, "fp32", "init")])
def test_every_rank_computes_with_torchaos_nf4_of_the_whole_weight(tmp_path, nproc, precision, source):
    path = None
    if source == "checkpoint":  # bf16 safetensors, 4 key/value heads: every projection quantizable
        path = tmp_path / "ckpt"
        path.mkdir()
        write_checkpoint(path, hidden=128, intermediate=256, layers=2, heads=4, vocab=512, layers_per_file=1)
    spec = ModelSpec(path=str(path) if path else None, arch=ARCH, lora=LORA)
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(WORKER),
           str(out), "--spec", spec.model_dump_json(), "--precision", precision]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference, plain = _reference(spec, DTYPES[precision])
    assert len(reference) == (7 if source == "checkpoint" else 5) * 2  # q, o, gate, up, down (+ k, v): 2 blocks
    ranks = [torch.load(out / f"rank-{r}.pt") for r in range(nproc)]
    for rank in ranks:
        assert rank["world"] == nproc
        assert set(rank["weights"]) == set(reference), "a weight is NF4 that should not be, or the reverse"
        for name, ref in reference.items():
            got = rank["weights"][name]
            for inner in INNER:  # the whole tensor's block scales, scaler blocks and mean: not a shard's
                assert torch.equal(got[inner], getattr(ref, inner)), (name, inner)
            assert got["dequantized"].dtype == DTYPES[precision]
            assert torch.equal(got["dequantized"], ref.get_original_weight()), name
        # the adapters, and only they, receive gradients through the NF4 weights
        assert rank["graded"] and all(".lora_" in n for n in rank["graded"])
        assert len(rank["graded"]) == 2 * 4 * 2  # lora_A and lora_B of q/k/v/o in 2 blocks
    if precision == "fp32":  # the loss is the plain model's with the dequantized weights (LoRA B starts at zero)
        model = build_model(spec.model_copy(update={"lora": LoraSpec()}), 0, {}, device="cpu")
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(reference[name].get_original_weight() if name in reference else plain[name])
            ids = fixed_batch(512)
            loss = float(model(input_ids=ids, labels=ids).loss)
        assert all(rank["loss"] == pytest.approx(loss, rel=1e-6) for rank in ranks)
        unquantized = float(build_model(spec.model_copy(update={"lora": LoraSpec()}), 0, {}, device="cpu")(
            input_ids=ids, labels=ids).loss)
        assert abs(unquantized - loss) > 1e-5  # the oracle tells NF4 from the dense weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(128, 128), (1024, 4096), (14336, 4096), (3840, 15360)])
def test_planned_nf4_bytes_equal_torchaos_storage(shape, dtype):
    """The planner's bytes per weight = the nbytes of every tensor torchao stores (meta: the layout without the
    data; the real small weight lays out the same)."""
    for device in ("meta", "cpu") if shape == (128, 128) else ("meta",):
        nf4 = to_nf4(torch.zeros(shape, dtype=dtype, device=device))
        stored = sum(getattr(nf4, name).nbytes for name in nf4.__tensor_flatten__()[0])
        assert nf4_bytes(shape[0] * shape[1], dtype.itemsize) == stored


def test_the_planner_counts_the_weights_the_model_quantizes():
    """`nf4_block_weights` (planner, from the shape) = the weights `quantize_frozen_base` makes NF4 (model)."""
    spec = ModelSpec(arch=ARCH, lora=LORA)
    model = apply_lora(build_model(spec, 0, {}, device="meta"), spec.lora)
    done = quantize_frozen_base(model, spec.lora, "bf16")
    from shardline.planning.memory import model_shape

    shape = model_shape(spec)
    assert ARCH.num_layers * sum(nf4_block_weights(shape, spec.lora)) == done.quantized_params
    assert sum(p.numel() for p in model.parameters() if is_nf4(p)) == done.quantized_params
    assert done.kept_params == ARCH.num_layers * 2 * 64 * 128  # k_proj, v_proj: 8,192 elements each
    assert "k_proj ×2, v_proj ×2" in done.describe()
    assert param_budget(shape, spec.lora).total == sum(p.numel() for p in model.parameters())
    head = model.get_base_model().lm_head.weight
    assert not is_nf4(head) and not is_nf4(model.get_base_model().model.embed_tokens.weight)
