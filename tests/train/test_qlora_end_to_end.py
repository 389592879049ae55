"""QLoRA (`model.lora.quantize_base: nf4`) on 2 ranks: it trains, its checkpoints hold the adapters only, a run started
from its checkpoint continues with the same losses, the adapter export loads with peft onto the base it names, and
`--merge-lora` writes the dequantized base with the adapters merged, which transformers loads with shardline's logits.
"""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from shardline.export import build_plain, checkpoint_store, export_run, load_model_entry
from shardline.rundir import read_spec
from tests.conftest import only_run, prepared_of_run, read_metrics, run_cli, small_overrides
from tests.oracle import unpacked_loss

# hidden 128, MLP 256: q/o and the MLP projections quantize (multiples of 64 × 256 elements); k/v (64 × 128) stay fp32
QLORA = ["model.arch.hidden_size=128", "model.arch.intermediate_size=256", "model.lora.enabled=true",
         "model.lora.r=4", "model.lora.quantize_base=nf4", "parallel.nproc_per_node=2", "observe.metrics_port=null",
         "observe.report=false"]


def _train(runs, *extra: str):
    sets = [*small_overrides(runs), *QLORA, *extra]
    proc = run_cli("train", "tiny", *[a for kv in sets for a in ("--set", kv)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return only_run(runs), proc.stdout


@pytest.mark.slow
def test_qlora_trains_resumes_exactly_and_exports_an_adapter_and_a_dequantized_merge(tmp_path):
    run_a, out = _train(tmp_path / "a", "checkpoint.every_steps=3")
    assert "QLoRA: 10 frozen linear weights" in out and "k_proj ×2, v_proj ×2" in out  # what is NF4, what is not
    losses = {r["step"]: r["loss"] for r in read_metrics(run_a, "train")}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1] - 0.05  # the adapters learn
    val = [r["val_loss"] for r in read_metrics(run_a, "eval") if "val_loss" in r][-1]

    # the checkpoint holds the adapters only, as a bf16-base LoRA's does: the NF4 base is re-derived from the spec
    spec = read_spec(run_a / "spec.yaml")
    store = checkpoint_store(spec, run_a)
    saved = {k for k in store.reader(6).read_metadata().state_dict_metadata if k.startswith("model.")}
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:4]

    # a new run started from step 3 of the first continues with its losses, step for step
    run_b, _ = _train(tmp_path / "b", f"checkpoint.resume_from={run_a}@3")
    resumed = {r["step"]: r["loss"] for r in read_metrics(run_b, "train")}
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == losses[s] for s in resumed), (resumed, losses)

    data = prepared_of_run(run_a)
    vocab = data.meta["vocab_size"]
    # the run's model rebuilt in this process: its NF4 base dequantized (fp32), the adapters from the checkpoint
    adapter = tmp_path / "adapter"
    export_run(run_a, adapter)  # in this process: test_training exports through the CLI
    ids = json.loads((adapter / "shardline_base.json").read_text())["special_ids"]
    ours = build_plain(spec, vocab, ids)
    load_model_entry(ours, store, 6, lora=True)
    assert unpacked_loss(ours.eval(), data) == pytest.approx(val, rel=1e-5)

    # adapter export: peft loads it onto the base it names (here shardline's seeded init, as shardline_base.json says)
    base_spec = spec.model_copy(deep=True)
    base_spec.model.lora.enabled, base_spec.model.lora.quantize_base = False, "none"
    on_base = PeftModel.from_pretrained(build_plain(base_spec, vocab, ids), adapter).eval()
    trained = dict(ours.named_parameters())
    for name, param in on_base.named_parameters():
        if ".lora_" in name:
            assert torch.equal(param, trained[name]), name
    q = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert not torch.equal(trained[q], dict(on_base.named_parameters())[q])  # NF4 moved the trained base's weights
    print(f"QLoRA: val loss {val:.6f}; the adapter on the unquantized base {unpacked_loss(on_base, data):.6f}")

    # --merge-lora: the dequantized base with the adapters merged, loaded by transformers alone
    merged_dir = tmp_path / "merged"
    export_run(run_a, merged_dir, merge_lora=True, dtype="fp32")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    ids_in = torch.arange(3, 3 + 48).view(2, 24) % vocab
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids_in).logits, ours(input_ids=ids_in).logits,
                                   rtol=1e-5, atol=1e-5)
    assert unpacked_loss(merged, data) == pytest.approx(val, rel=1e-5)
