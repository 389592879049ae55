"""Tensor parallel (`parallel.tp`) on real 4-process gloo runs: FSDP × TP trains the same losses as FSDP alone,
survives kill -9 with exact resume, reshards its checkpoints to another (dp, tp) layout, and exports a model
transformers loads with the run's validation loss. The spec rules name each broken layout."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

from shardline.checkpointing.state import rng_source_rank
from shardline.data.prepare import PreparedData
from shardline.errors import SpecError
from shardline.export import build_plain, export_run
from shardline.parallel.fsdp import enable_async_tp
from shardline.parallel.tensor import check_tensor_parallel
from shardline.rundir import read_spec, run_path
from shardline.spec import JobSpec
from shardline.spec.resolve import load_spec
from shardline.training.optim import clip_grad_norm
from tests.conftest import prepared_of_run, read_metrics, workers
from tests.oracle import unpacked_loss
from tests.train.test_preemption import _losses, _start, _wait_for_step
from tests.train.world_worker import created, run_world

STEPS = 8
COMMON = ["train.precision=fp32", f"train.max_steps={STEPS}", "checkpoint.every_steps=4", "train.lr=1e-2",
          "train.global_batch_size=8", "train.micro_batch_size=2", "observe.report=false"]


def test_tp_must_divide_the_node_the_world_and_the_heads():
    with pytest.raises(SpecError, match="parallel.tp: 3 does not divide parallel.nproc_per_node=4"):
        load_spec("tiny", ["parallel.nproc_per_node=4", "parallel.tp=3", "train.global_batch_size=32"])
    with pytest.raises(SpecError, match="parallel.tp: 8 does not divide model.arch.num_heads=4"):
        load_spec("tiny", ["parallel.nproc_per_node=8", "parallel.tp=8", "train.global_batch_size=32",
                           "model.arch.num_heads=4", "model.arch.num_kv_heads=4"])
    with pytest.raises(SpecError, match=r"dp_replicate × dp_shard × tp = 2 × 1 × 2 does not equal the world size 8"):
        load_spec("tiny", ["parallel.nproc_per_node=8", "parallel.tp=2", "parallel.dp_replicate=2",
                           "parallel.dp_shard=1", "train.global_batch_size=32"])
    # the batch divides over data-parallel ranks: 4 ranks at tp 2 are 2 data-parallel ranks
    with pytest.raises(SpecError, match=r"data-parallel ranks \(world size 4 ÷ parallel.tp 2\)"):
        load_spec("tiny", ["parallel.nproc_per_node=4", "parallel.tp=2", "train.micro_batch_size=3",
                           "train.global_batch_size=8"])
    spec = load_spec("tiny", ["parallel.nproc_per_node=4", "parallel.tp=2", "train.micro_batch_size=2",
                              "train.global_batch_size=4"])
    assert spec.parallel.tp == 2 and spec.world_size == 4


def test_async_tp_needs_tp_compile_and_cuda():
    four = ["parallel.nproc_per_node=4", "train.global_batch_size=8", "train.micro_batch_size=2"]
    with pytest.raises(SpecError, match=r"parallel.async_tp: needs tensor parallel and compiled blocks \(tp=2, "
                                        r"compile=false\)"):
        load_spec("tiny", [*four, "parallel.tp=2", "parallel.async_tp=true"])
    with pytest.raises(SpecError, match=r"parallel.async_tp: needs tensor parallel .* \(tp=1, compile=true\)"):
        load_spec("tiny", [*four, "parallel.async_tp=true", "parallel.compile=true"])
    spec = load_spec("tiny", [*four, "parallel.tp=2", "parallel.async_tp=true", "parallel.compile=true"])
    with pytest.raises(SpecError, match="parallel.async_tp: needs CUDA .* on cpu"):
        enable_async_tp(spec.parallel, "cpu")
    assert not torch._inductor.config._micro_pipeline_tp
    enable_async_tp(load_spec("tiny", four).parallel, "cpu")  # off: nothing to check


def test_fused_projections_and_heads_tp_does_not_divide_are_refused_by_name():
    phi3 = Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=256)
    with pytest.raises(SpecError, match="Phi-3 fuses q/k/v"):
        check_tensor_parallel(phi3, 2)
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256)
    with pytest.raises(SpecError, match="4 does not divide the model's num_key_value_heads=2"):
        check_tensor_parallel(llama, 4)
    check_tensor_parallel(llama, 2)
    check_tensor_parallel(phi3, 1)  # tp 1: nothing to check


def test_clipping_over_several_meshes_equals_torchs_clip_on_plain_tensors():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p) * 4
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for t, p in zip(twins, params, strict=True):
        t.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(twins, 1.0, foreach=True)
    got = clip_grad_norm(params, 1.0)
    torch.testing.assert_close(got, expected)
    for t, p in zip(twins, params, strict=True):
        torch.testing.assert_close(p.grad, t.grad)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Where the module's runs live, beside the one prepared-data cache they share."""
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def killed_tp_run(root) -> Path:
    """FSDP 2 × TP 2 through `shardline train`, its last worker killed -9 at step 6 with step 4 committed: the run
    directory of the run that restarted and finished."""
    runs = root / "killed"
    proc = _start(runs, *COMMON, "parallel.tp=2", "launch.max_restarts=1", nproc=4)
    run = _wait_for_step(runs, 6, proc, committed=4)
    os.kill(workers(run)[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    return run


LORA = ["model.lora.enabled=true", "model.lora.r=4"]
DROPPING = [*LORA, "model.lora.dropout=0.5", "model.lora.target_modules=[q_proj,v_proj,o_proj,down_proj]"]


@pytest.fixture(scope="module")
def world(root, killed_tp_run) -> dict[str, Path]:
    """The module's other runs on one 4-rank world (world_worker.py), by name → run directory: FSDP ×4 (the losses
    tensor parallel must reproduce), FSDP ×4 resumed from the killed run's step 4, LoRA under FSDP and under TP,
    TP with selective checkpointing and compile, and the runs whose tensor-parallel peers are compared."""
    def spec(name: str, *extra: str) -> JobSpec:
        return created(root / name, *COMMON, "parallel.nproc_per_node=4", *extra)

    # 16 new tokens: a few steps' model does not stop by itself, and every one-token step under TP costs collectives
    lora = [*LORA, "model.lora.dropout=0", "train.max_steps=4", "checkpoint.every_steps=100", "train.eval_examples=4",
            "train.eval_max_new_tokens=16"]
    # tp 1 → 2: the tp 1 run's 4 data-parallel ranks saved their own RNG streams at step 2 (of 4)
    tp1 = spec("lora-tp1", *DROPPING, "train.max_steps=4", "checkpoint.every_steps=2")
    jobs = {
        "fsdp": {"spec": spec("fsdp"), "fit": True},
        "reshard": {"spec": spec("reshard", f"checkpoint.resume_from={killed_tp_run}@4"), "fit": True},
        "lora-fsdp": {"spec": spec("lora-fsdp", *lora), "fit": True},
        "lora-tp": {"spec": spec("lora-tp", *lora, "parallel.tp=2"), "fit": True},
        "whole-full": {"spec": spec("whole-full", "parallel.tp=2"), "steps": 3},
        "whole-lora": {"spec": spec("whole-lora", "parallel.tp=2", *DROPPING), "steps": 3},
        "lora-tp1": {"spec": tp1, "steps": 2, "save": True},
        "lora-resumed": {"spec": spec("lora-resumed", *DROPPING, "train.max_steps=4", "checkpoint.every_steps=2",
                                      "parallel.tp=2", f"checkpoint.resume_from={run_path(tp1)}@2"), "steps": 2},
        # last: compiled blocks leave nothing behind for the runs before them
        "compiled": {"spec": spec("compiled", "train.max_steps=3", "checkpoint.every_steps=100", "parallel.tp=2",
                                  "parallel.activation_checkpointing=selective", "parallel.compile=true",
                                  "train.eval_examples=4", "train.eval_max_new_tokens=4"), "fit": True},
    }
    for name in ("whole-full", "whole-lora", "lora-resumed"):
        jobs[name]["out"] = str(root / f"{name}.json")
    run_world(root, list(jobs.values()))
    return {name: run_path(job["spec"]) for name, job in jobs.items()}


def _peers(world: dict[str, Path], name: str) -> tuple[dict[str, float], dict[str, float]]:
    """world_worker.py's largest difference between tensor-parallel peers per parameter TP leaves whole, and how far
    the job's steps moved it."""
    out = json.loads((world[name].parent.parent / f"{name}.json").read_text())
    return out["peers"], out["moved"]


def _dataset(run: Path) -> PreparedData:
    return prepared_of_run(run)


@pytest.mark.slow
def test_fsdp_x_tp_trains_resumes_after_kill_9_reshards_and_exports(tmp_path, killed_tp_run, world):
    run, reference = killed_tp_run, _losses(world["fsdp"])
    setup = next(e for e in read_metrics(run, "event") if e["event"] == "setup")
    # 2 blocks × (q, k, v, o, gate, up, down) and the untied head split over tp; FSDP over the other 2 ranks
    assert setup["mesh"] == {"dp_shard": 2, "tp": 2} and setup["tensor_parallel_weights"] == 15
    assert setup["loss_parallel"]
    resumes = [e for e in read_metrics(run, "event") if e["event"] == "resume"]
    assert resumes and resumes[0]["step"] == 4 and resumes[0]["rng_restored"]
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in reference.items():  # TP only changes the order of sums: fp32 rounding
        assert losses[step] == pytest.approx(loss, rel=2e-5), step
    # The rows each data-parallel rank trained: tensor-parallel peers (ranks 0-1, 2-3) read the same ones.
    traces = {r: [json.loads(line)["rows"] for line in (run / "logs" / f"samples-rank-{r}.jsonl").open()]
              for r in range(4)}
    assert traces[0] == traces[1] and traces[2] == traces[3] and traces[0] != traces[2]

    # The step-4 checkpoint of FSDP 2 × TP 2 resumes as FSDP 4 (tp 1) with the same losses.
    resumed = _losses(world["reshard"])
    assert sorted(resumed) == list(range(5, STEPS + 1))
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=2e-5), step

    # Export: one Hugging Face model, which transformers loads with the run's validation loss.
    export_run(run, tmp_path / "hf")
    val = [r["val_loss"] for r in read_metrics(run, "eval") if "val_loss" in r][-1]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert unpacked_loss(model, _dataset(run)) == pytest.approx(val, rel=1e-5)


@pytest.mark.slow
def test_tp_with_selective_checkpointing_and_compile_trains_fsdps_losses_and_generates(world):
    """Sequence parallel's DTensors inside compiled, checkpointed blocks (a batch of another shape once made dynamo's
    dynamic shapes fail: blocks compile per shape under TP) train FSDP ×4's losses (plain blocks; its first 3 steps
    do not depend on the schedule's length: warm-up is 2 steps); greedy generation runs through them too (4 tokens:
    each length is a shape to compile)."""
    run = world["compiled"]
    losses, reference = _losses(run), _losses(world["fsdp"])
    assert sorted(losses) == [1, 2, 3]
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=2e-5), step
    # equal losses alone would pass with TP, compile or selective checkpointing dropped: the run says what it built
    setups = {name: next(e for e in read_metrics(world[name], "event") if e["event"] == "setup")
              for name in ("compiled", "fsdp")}
    assert setups["compiled"]["mesh"] == {"dp_shard": 2, "tp": 2}
    assert setups["compiled"]["tensor_parallel_weights"] == 15 and setups["compiled"]["loss_parallel"]
    assert setups["compiled"]["blocks"] == {"blocks": 2, "compiled": 2, "checkpointed": 2, "selective": 2}
    assert setups["fsdp"]["blocks"] == {"blocks": 2, "compiled": 0, "checkpointed": 0, "selective": 0}
    assert len(json.loads((run / "eval.json").read_text())["samples"]) == 4


@pytest.mark.slow
def test_lora_under_tp_trains_like_fsdp_and_its_adapter_reloads(tmp_path, world):
    """LoRA's factors follow the split: lora_B column-wise beside a column-wise base, lora_A row-wise beside a
    row-wise one, the other factor replicated. Without dropout FSDP 2 × TP 2 trains the losses FSDP ×4 trains, generates
    the same SQL, and the exported adapter reloads with the run's validation loss."""
    runs = {name: world[f"lora-{name}"] for name in ("fsdp", "tp")}
    losses = {name: _losses(run) for name, run in runs.items()}
    assert sorted(losses["tp"]) == [1, 2, 3, 4]
    for step, loss in losses["fsdp"].items():
        assert losses["tp"][step] == pytest.approx(loss, rel=2e-5), step
    # Greedy generation under TP: one-token steps run on whole rows (no sequence shard of one token), and the
    # SQL evaluation writes what FSDP's run writes.
    preds = {name: [s["pred"] for s in json.loads((run / "eval.json").read_text())["samples"]]
             for name, run in runs.items()}
    assert len(preds["tp"]) == 4 and preds["tp"] == preds["fsdp"]
    run = runs["tp"]
    export_run(run, tmp_path / "adapter")
    spec = read_spec(run / "spec.yaml")
    spec.model.lora.enabled = False
    data = _dataset(run)
    base = build_plain(spec, data.meta["vocab_size"],
                       json.loads((tmp_path / "adapter" / "shardline_base.json").read_text())["special_ids"])
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    val = [r["val_loss"] for r in read_metrics(run, "eval") if "val_loss" in r][-1]
    assert unpacked_loss(model, data) == pytest.approx(val, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_what_tp_leaves_whole_stays_identical_on_tensor_parallel_peers(world, lora):
    """Norms, embeddings and LoRA's replicated factors are copies on each TP rank: after 3 steps (with LoRA dropout:
    peers must draw the same masks) they must be bitwise equal across peers, or the ranks silently train different
    models. Equal because frozen proves nothing: full training moves the norms and embeddings, LoRA its factors.
    (QK-norm, whose gradient is a partial sum over a rank's heads: tests/model.)"""
    peers, moved = _peers(world, "whole-lora" if lora else "whole-full")
    assert any("layernorm" in n for n in peers) and any("embed_tokens" in n for n in peers)
    assert any(n.endswith("model.norm.weight") for n in peers)
    if lora:  # the replicated factors: lora_A beside a column-wise base (q, v), lora_B beside a row-wise one (o, down)
        trained = [n for n in peers if "q_proj.lora_A" in n or "o_proj.lora_B" in n]
        assert any("q_proj.lora_A" in n for n in trained) and any("o_proj.lora_B" in n for n in trained)
    else:
        trained = list(peers)
    assert {n: moved[n] for n in trained if not moved[n] > 0} == {}  # they trained
    assert {n: d for n, d in peers.items() if d != 0} == {}


@pytest.mark.slow
def test_lora_resumed_at_another_tp_keeps_tensor_parallel_peers_identical(world):
    """Data-parallel ranks of a tp=1 run (their own RNG streams) resume at tp=2 as tensor-parallel peers: each pair
    must restore one saved stream (that of their data-parallel index), or LoRA dropout draws other masks on each and
    the replicated factors drift apart — silently, since the checkpoint keeps one copy of a replicated tensor."""
    peers, moved = _peers(world, "lora-resumed")
    resumes = [e for e in read_metrics(world["lora-resumed"], "event") if e["event"] == "resume"]
    assert [(e["step"], e["rng_restored"]) for e in resumes] == [(2, True)]
    # replicated factors beside a column-wise (q, v: lora_A) and a row-wise (o, down: lora_B) base
    replicated = [n for n in peers if ("q_proj.lora_A" in n or "o_proj.lora_B" in n)]
    assert any("q_proj.lora_A" in n for n in replicated) and any("o_proj.lora_B" in n for n in replicated)
    assert {n: moved[n] for n in replicated if not moved[n] > 0} == {}  # they trained after the resume
    assert {n: d for n, d in peers.items() if d != 0} == {}


def test_rng_streams_a_rank_restores_follow_its_data_parallel_index_when_the_layout_changes():
    def sources(world: int, per_row: int, saved_world: int, saved_per_row: int) -> list[int | None]:
        return [rng_source_rank(r, world, per_row, saved_world, saved_per_row) for r in range(world)]

    assert sources(4, 2, 4, 2) == [0, 1, 2, 3]  # the saved layout: every rank its own streams (exact resume)
    assert sources(2, 2, 2, 1) == [0, 0]  # tp 1 → 2: both peers restore data-parallel rank 0's streams
    assert sources(4, 2, 2, 1) == [0, 0, 1, 1]  # and on a larger world
    assert sources(2, 1, 2, 2) == [0, None]  # tp 2 → 1: data-parallel rank 1 was not saved, it starts fresh
    assert sources(2, 1, 4, 2) == [0, 2]  # 4 ranks at tp 2 → 2 at tp 1: one stream per saved data-parallel rank
    assert sources(4, 1, 2, 1) == [0, 1, None, None]  # the world grows
    assert sources(4, 2, 4, 4) == [0, 0, None, None]  # context × tensor parallel rows are peers too
    assert sources(2, 1, 0, 1) == [None, None]  # a checkpoint without RNG streams
