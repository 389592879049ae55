"""Context parallel (`parallel.cp`): attention of a rank's load-balanced tokens over the whole row equals
per-document attention on whole rows (outputs and gradients, windows and GQA); a 4-process gloo run at
FSDP 2 × CP 2 (and HSDP 2 × CP 2) trains FSDP ×4's losses, validation loss and generations, and its checkpoint
resumes without CP.
The spec rules name each broken layout."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import Gemma2Config

from shardline.errors import SpecError
from shardline.parallel.context import check_context_parallel
from shardline.rundir import run_path
from shardline.spec.resolve import load_spec
from tests.conftest import REPO, read_metrics
from tests.train.test_preemption import _losses
from tests.train.world_worker import created, run_world

STEPS = 5
COMMON = ["parallel.nproc_per_node=4", "train.precision=fp32", f"train.max_steps={STEPS}", "train.warmup_steps=0",
          "checkpoint.every_steps=2", "train.lr=1e-2", "train.global_batch_size=8", "train.micro_batch_size=2",
          "observe.report=false", "train.seq_len=256", "train.eval_examples=6",
          "train.eval_max_new_tokens=16"]  # a few steps' model does not stop by itself: 96 one-token steps a row


def test_cp_rules_name_the_field_and_the_fix():
    four = ["parallel.nproc_per_node=4", "train.global_batch_size=8", "train.micro_batch_size=2"]
    with pytest.raises(SpecError, match=r"train.seq_len: 192 is not a multiple of parallel.cp × 128 = 256"):
        load_spec("tiny", [*four, "parallel.cp=2", "train.seq_len=192"])
    with pytest.raises(SpecError, match="parallel.cp: 2 with parallel.tp=2: context parallel does not compose"):
        load_spec("tiny", [*four, "parallel.cp=2", "parallel.tp=2", "train.seq_len=256"])
    with pytest.raises(SpecError, match=r"data-parallel ranks \(world size 4 ÷ parallel.cp 2\) × micro-batch = 2 × 3"):
        load_spec("tiny", [*four, "parallel.cp=2", "train.seq_len=256", "train.micro_batch_size=3"])
    with pytest.raises(SpecError, match=r"dp_replicate × dp_shard × cp × tp = 1 × 1 × 2 × 1 does not equal the world"):
        load_spec("tiny", [*four, "parallel.cp=2", "parallel.dp_shard=1", "train.seq_len=256"])
    with pytest.raises(SpecError, match="model.attn_implementation: is eager, but parallel.cp=2"):
        load_spec("tiny", [*four, "parallel.cp=2", "train.seq_len=256", "model.attn_implementation=eager"])
    spec = load_spec("tiny", [*four, "parallel.cp=2", "train.seq_len=256", "model.arch.max_position_embeddings=256"])
    assert spec.parallel.ranks_per_row == 2 and spec.grad_accum_steps == 2  # 8 rows over 2 data-parallel ranks × 2


def test_soft_capped_attention_is_refused_under_cp_by_name():
    gemma2 = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=256)
    with pytest.raises(SpecError, match="Gemma 2 soft-caps its attention scores"):
        check_context_parallel(gemma2, 2)
    check_context_parallel(gemma2, 1)


def test_attention_dropout_is_refused_under_cp_by_name_not_dropped():
    from transformers import LlamaConfig

    dropping = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           attention_dropout=0.1)
    with pytest.raises(SpecError, match="attention_dropout is 0.1"):
        check_context_parallel(dropping, 2)
    check_context_parallel(dropping, 1)
    check_context_parallel(LlamaConfig(hidden_size=64, num_attention_heads=4), 2)


def test_a_ranks_tokens_attend_over_the_whole_row_as_per_document_attention_does(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(REPO / "tests" / "model" / "cp_attention_worker.py"), str(tmp_path / "out.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads((tmp_path / "out.json").read_text())
    assert len(ranks) == 2 and all(len(cases) == 4 for cases in ranks)  # windows × GQA, on each rank's tokens
    for cases in ranks:
        for case, diffs in cases.items():
            assert max(diffs.values()) < 1e-12, (case, diffs)  # float64


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    """Four runs on one 4-rank world (world_worker.py), by name → run directory: FSDP ×4, FSDP 2 × CP 2, HSDP 2 × CP 2,
    and FSDP ×4 resumed from the CP run's step-2 checkpoint."""
    root = tmp_path_factory.mktemp("cp")
    cp = created(root / "cp", *COMMON, "parallel.cp=2")
    specs = {"fsdp": created(root / "fsdp", *COMMON), "cp": cp,
             "hsdp-cp": created(root / "hsdp-cp", *COMMON, "parallel.cp=2", "parallel.dp_replicate=2",
                                "parallel.dp_shard=1"),
             "resumed": created(root / "resumed", *COMMON, f"checkpoint.resume_from={run_path(cp)}@2")}
    run_world(root, [{"spec": spec, "fit": True} for spec in specs.values()])
    return {name: run_path(spec) for name, spec in specs.items()}


@pytest.mark.slow
def test_fsdp_x_cp_trains_fsdps_losses_and_its_checkpoint_resumes_without_cp(layouts):
    runs = {name: layouts[name] for name in ("fsdp", "cp", "hsdp-cp")}
    meshes = {name: next(e for e in read_metrics(runs[name], "event") if e["event"] == "setup")["mesh"]
              for name in ("cp", "hsdp-cp")}
    assert meshes == {"cp": {"dp_shard": 2, "cp": 2}, "hsdp-cp": {"dp_replicate": 2, "dp_shard": 1, "cp": 2}}
    losses = {name: _losses(run) for name, run in runs.items()}
    for layout in ("cp", "hsdp-cp"):  # HSDP: replicas × (shard × cp flattened)
        assert sorted(losses[layout]) == list(range(1, STEPS + 1))
        for step, loss in losses["fsdp"].items():  # CP only changes the order of sums: fp32 rounding
            assert losses[layout][step] == pytest.approx(loss, rel=1e-5), (layout, step)
    val = {name: [r["val_loss"] for r in read_metrics(run, "eval") if "val_loss" in r][-1]
           for name, run in runs.items()}
    for layout in ("cp", "hsdp-cp"):
        assert val[layout] == pytest.approx(val["fsdp"], rel=1e-5), layout
    # generation runs whole prompts on every rank of a context-parallel group: the same SQL as FSDP's
    preds = {name: [s["pred"] for s in json.loads((run / "eval.json").read_text())["samples"]]
             for name, run in runs.items()}
    assert len(preds["fsdp"]) == 6 and preds["cp"] == preds["fsdp"] and preds["hsdp-cp"] == preds["fsdp"]

    # the step-2 checkpoint of FSDP 2 × CP 2 resumes as FSDP ×4 and trains FSDP's steps 3-5
    resumes = [e for e in read_metrics(layouts["resumed"], "event") if e["event"] == "resume"]
    assert [(e["step"], e["world"]) for e in resumes] == [(2, 4)]
    after = _losses(layouts["resumed"])
    assert sorted(after) == [3, 4, 5]
    for step in after:
        assert after[step] == pytest.approx(losses["fsdp"][step], rel=1e-5), step
