"""LoRA on 2 ranks with untied embeddings (the real checkpoint covers tied ones), one run that the tests read: only
the adapters train and are saved, the end-of-run generation eval runs on the peft-wrapped FSDP2 model, and both export
formats reproduce shardline's validation loss."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from peft import PeftModel
from transformers import AutoModelForCausalLM

from shardline.export import build_plain, export_run
from shardline.rundir import read_spec
from tests.conftest import only_run, prepared_of_run, read_metrics, run_cli, small_overrides
from tests.oracle import unpacked_loss


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    sets = [*small_overrides(tmp / "runs"), "parallel.nproc_per_node=2", "model.lora.enabled=true",
            "model.lora.r=4", "train.precision=fp32", "train.eval_examples=6", "train.eval_max_new_tokens=16",
            "train.lr=1e-2", "observe.metrics_port=null", "observe.report=false"]
    proc = run_cli("train", "tiny", *[a for kv in sets for a in ("--set", kv)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return only_run(tmp / "runs")


@pytest.mark.slow
def test_a_lora_run_trains_and_saves_only_its_adapters(lora_run):
    train = read_metrics(lora_run, "train")
    assert train[-1]["loss"] < train[0]["loss"]
    params = [e for e in read_metrics(lora_run, "event") if e["event"] == "setup"][0]["params"]
    assert 0 < params["trainable"] < 0.1 * params["frozen"]
    keys = dcp.FileSystemReader(str(lora_run / "checkpoints" / "step-00000006")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)


@pytest.mark.slow
def test_lora_run_with_generation_eval_exits_0_and_exports_reproduce_its_validation_loss(lora_run, tmp_path):
    run_dir = lora_run
    assert json.loads((run_dir / "eval.json").read_text())["n"] == 6
    val = [r["val_loss"] for r in read_metrics(run_dir, "eval") if "val_loss" in r][-1]
    data = prepared_of_run(run_dir)
    for merge in (False, True):  # in this process: test_training exports through the CLI
        out = tmp_path / f"export-merged-{merge}"
        export_run(run_dir, out, merge_lora=merge)
        if merge:
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        else:  # the base of an arch-built model is shardline's seeded init, rebuilt as shardline_base.json says
            spec = read_spec(run_dir / "spec.yaml")
            spec.model.lora.enabled = False
            base = build_plain(spec, data.meta["vocab_size"], json.loads((out / "shardline_base.json").read_text())
                               ["special_ids"])
            model = PeftModel.from_pretrained(base, out)
        assert not model.config.tie_word_embeddings
        assert unpacked_loss(model.eval(), data) == pytest.approx(val, rel=1e-5)
