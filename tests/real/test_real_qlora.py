"""QLoRA on the real SmolLM2-135M-Instruct: the first loss with an NF4 base against the bf16-base LoRA's, both built
as the Trainer builds them (meta → LoRA → NF4 base → FSDP on this process's world-1 mesh → materialize, bf16), on the
same packed documents; the difference is NF4's own, measured independently on transformers' bf16 model with torchao's
NF4 round trip of the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor
from torchao.quantization import to_nf4  # the independent round trip
from transformers import AutoModelForCausalLM

from shardline.data.prepare import PreparedData, prepare
from shardline.model.build import build_model
from shardline.model.lora import apply_lora, quantize_frozen_base
from shardline.model.nf4 import is_nf4
from shardline.model.sharded_load import materialize
from shardline.parallel.fsdp import device_mesh, parallelize
from shardline.spec import ParallelSpec
from shardline.spec.resolve import load_spec
from tests.real.checkpoint import smollm2_dir
from tests.real.runs import run_sets, user_sql_file

pytestmark = pytest.mark.slow
IGNORE = -100
ROWS = 2  # packed training rows scored (6 documents, 160 loss tokens): bf16 on 2 cores, seconds per model


def _shardline(spec, data: PreparedData) -> torch.nn.Module:
    model = build_model(spec.model, data.meta["vocab_size"], {}, device="meta")
    model = apply_lora(model, spec.model.lora)
    quantize_frozen_base(model, spec.model.lora, "bf16")
    parallelize(model, device_mesh(ParallelSpec(), 1, "cpu"), ParallelSpec(), "bf16")
    materialize(model, spec.model, torch.device("cpu"))
    return model.eval()


@torch.no_grad()
def _loss(model, data: PreparedData) -> float:
    """Token-weighted loss of the first training rows' documents, each alone (the first step's loss, unpacked): one
    forward of the documents right-padded into a batch (causal: a token never sees the padding after it), since
    torchao dequantizes every NF4 weight again in each forward (0.08 s per MLP weight on this CPU)."""
    rows, docs = data.rows("train"), []
    for r in range(ROWS):
        n = int(rows.n_real[r])
        starts = [*np.flatnonzero(np.asarray(rows.position_ids[r, :n]) == 0).tolist(), n]
        docs += [(np.asarray(rows.tokens[r, a:b], dtype=np.int64), np.asarray(rows.loss_mask[r, a:b], dtype=bool))
                 for a, b in zip(starts, starts[1:], strict=False)]
    width = max(len(t) for t, _ in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    labels = torch.full((len(docs), width), IGNORE)
    for i, (tokens, mask) in enumerate(docs):
        ids[i, : len(tokens)] = torch.from_numpy(tokens)
        labels[i, : len(tokens)] = torch.where(torch.from_numpy(mask), torch.from_numpy(tokens), IGNORE)
    logits = model(input_ids=ids).logits.float()
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                   ignore_index=IGNORE))


def _param_bytes(model) -> int:
    """Bytes this rank holds for the model's parameters (an NF4 weight: every tensor torchao stores)."""
    total = 0
    for p in model.parameters():
        if is_nf4(p):
            total += sum(getattr(p, name).nbytes for name in p.__tensor_flatten__()[0])
        else:
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total


def test_qlora_first_loss_is_the_bf16_lora_loss_moved_by_nf4s_own_error(ctx, tmp_path: Path):
    real = smollm2_dir()
    args = run_sets(real, user_sql_file(tmp_path), tmp_path, 1, "data.prompt_format=chat", "train.precision=bf16",
                    "model.lora.enabled=true")[1::2]
    data = prepare(load_spec("tiny", args))
    qlora = load_spec("tiny", [*args, "model.lora.quantize_base=nf4"])
    lora = load_spec("tiny", args)
    ours_q, ours_b = _shardline(qlora, data), _shardline(lora, data)
    assert sum(is_nf4(p) for p in ours_q.parameters()) == 90  # gate/up/down of 30 blocks; 576-wide q/k/v/o stay
    loss_q, loss_b = _loss(ours_q, data), _loss(ours_b, data)
    bytes_q, bytes_b = _param_bytes(ours_q), _param_bytes(ours_b)
    del ours_q, ours_b

    # NF4's own effect, without shardline: transformers' bf16 model, its MLP weights through torchao's round trip
    theirs = AutoModelForCausalLM.from_pretrained(real, dtype=torch.bfloat16).eval()
    errors = []
    theirs_b = _loss(theirs, data)
    with torch.no_grad():
        for name, module in theirs.named_modules():
            if name.endswith(("gate_proj", "up_proj", "down_proj")):
                w = module.weight.detach().clone()
                module.weight.copy_(to_nf4(w).get_original_weight())
                errors.append(float((module.weight.float() - w.float()).norm() / w.float().norm()))
    theirs_q = _loss(theirs, data)
    eps = float(np.sqrt(np.mean(np.square(errors))))
    print(f"SmolLM2 first loss: bf16-base LoRA {loss_b:.5f}, QLoRA {loss_q:.5f} ({(loss_q - loss_b) / loss_b:+.2%}); "
          f"transformers bf16 {theirs_b:.5f} → NF4 round trip {theirs_q:.5f} ({(theirs_q - theirs_b) / theirs_b:+.2%});"
          f" NF4 relative RMS error of the 90 weights {eps:.4f}; parameters {bytes_b / 2**20:.1f} → "
          f"{bytes_q / 2**20:.1f} MiB")
    # Tolerance. NF4 moves each quantized weight by a relative RMS error ε (measured: 0.093, 16 levels per 64-element
    # block); a block's output moves by about ε of its MLP's share, and the loss by O(ε) of itself: measured +10-12%
    # on this small model (4 bits hurt small models most; its GGUF source was already 4-bit). So:
    # (1) the QLoRA loss lies above the bf16-base loss by less than 2ε of it (a wrong scale or code book moves it by
    #     multiples: the loss of random weights is ln(49152) = 10.8);
    assert 0 < loss_q - loss_b < 2 * eps * loss_b
    # (2) and by NF4's own effect on transformers' model, within bf16 noise: both sides round activations to bf16
    #     (eps 2^-8 = 0.4%) in kernels of different blocking; 1% of the loss bounds that noise on both differences.
    assert abs((loss_q - loss_b) - (theirs_q - theirs_b)) < 0.01 * loss_b
    assert abs(loss_b - theirs_b) < 0.01 * loss_b  # the baseline itself is transformers' bf16 loss
    # memory: the MLP weights (79.6M) in NF4 instead of bf16: 0.5157 instead of 2 bytes each
    saved = 90 * 884_736 * (2 - 0.5157)
    assert bytes_b - bytes_q == pytest.approx(saved, rel=1e-3)
