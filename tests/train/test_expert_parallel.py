"""Expert parallel (`parallel.ep`, shardline/parallel/expert.py) against transformers' own mixture of experts.

One torchrun launch per world size runs every case of that world (tests/train/expert_parallel_worker.py): on a tiny
Qwen3-MoE (transformers' config class, fp32, dims multiples of 8, init std 0.2 so a mis-routed token moves the loss)
the step-0 loss and every gradient equal transformers' unsharded model on the same weights and whole batch at ep 1
(FSDP 2), ep 2 (EP 2, its experts `(Shard(1), Shard(0))` over `[efsdp, ep]`; Mixtral and Qwen2-MoE, whose shared
expert has a sigmoid gate, too) and, on 4 ranks, FSDP 2 × EP 2 and HSDP 2 × EP 2; with LoRA adapters per expert
(drawn nonzero, sharded like their weights) at ep 2 and FSDP 2 × EP 2 the loss is transformers' with the adapters
merged into its weights and the adapters' gradients those derived from its merged weights' gradients; a
dispatch that sends every token to the next EP rank's experts, or a combine that leaves out the routing weights,
fails that oracle; the router aux loss, from expert
counts all-reduced over the ranks, equals transformers' on the whole batch; and the Trainer of a checkpoint saved by
transformers takes the same 3 steps at ep 2 (with activation checkpointing: the dispatch runs again in backward)
as at ep 1 (and counts the same tokens per expert), its ep 2
checkpoint resumes at ep 1 and ep 1's at ep 2 with ep 1's next loss; LoRA on the attention, the routed experts and
the routers trains the same losses at ep 2 as at ep 1 (and in bf16 to bf16 precision), and its ep 1 checkpoint
resumes at ep 2 with ep 1's next loss; with a
capacity factor that drops (`train.expert_capacity_factor`), ep 2 with selective activation checkpointing trains ep
1's losses and drops the same copies;
with router biases (`train.router_bias_update_rate`) ep 2 trains ep 1's losses and loads, ep 1's checkpoint
resumes at ep 2 with its biases and ep 1's next loss, and its `shardline export` warns that the biases are left out;
in bf16 with a capacity factor, router biases and the router z-loss, ep 2 trains the same run's fp32 losses to bf16
precision; on 4 ranks, with a capacity factor and router biases, FSDP 2 × EP 2 trains FSDP 4's losses, loads and drops.
A tiny Mixtral and a tiny Qwen3-MoE saved by transformers each train from `shardline train --set parallel.ep=2` on 2
ranks, record the tokens per expert, are killed with SIGKILL and retrain the lost step bit-exact, and export with the
input's keys a model transformers loads with the run's validation loss.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from shardline.data.prepare import prepare
from shardline.data.tokenizer import train_bpe
from shardline.errors import SpecError
from shardline.parallel.expert import check_expert_parallel
from shardline.rundir import create_run
from shardline.spec.resolve import load_spec
from shardline.tasks.text_to_sql.generate import generate_splits
from tests.conftest import (
    REPO,
    cli_in_background,
    kill_the_stopped_worker,
    prepared_of_run,
    read_metrics,
    small_overrides,
)
from tests.model.families import write_family_checkpoint
from tests.model.test_moe import write_checkpoint
from tests.oracle import unpacked_loss

WORKER = Path(__file__).with_name("expert_parallel_worker.py")
GRAD_TOL = 1e-6  # fp32: summation order of the ranks' gradients (measured ~5e-8 of gradients up to 0.16)
LOSS_TOL = 4e-6  # a few fp32 ulps of a loss of ~7.7 (transformers' loss is fp32; measured up to 7.5e-7)


def launch(root: Path, world: int, jobs: list[dict]) -> None:
    (root / "jobs.json").write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(WORKER),
           str(root / "jobs.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def oracle_result(path: Path) -> tuple[float, float, float]:
    """(loss − transformers' loss, largest gradient difference, the expert weights' placements) of an oracle job."""
    found = json.loads(path.read_text())
    placed = found["expert_placements"]
    weight = placed["model.layers.0.mlp.experts.gate_up_proj"]
    adapters = [k for k in placed if ".lora_" in k]
    assert all(placed[k] == weight for k in adapters), placed  # LoRA's per-expert adapters sharded like their weights
    assert len(adapters) == (8 if "lora" in path.name else 0)  # 2 layers × (A, B) × (gate_up_proj, down_proj)
    return abs(found["loss"] - found["reference_loss"]), max(found["grad_diff"].values()), weight


def qwen3_moe_checkpoint(root: Path) -> Path:
    """A tiny Qwen3-MoE saved by transformers under `root`, with a tokenizer trained on the generated SQL data."""
    examples = generate_splits(5, 300, 10, 10)["train"]
    tok = train_bpe([t for e in examples for t in (e.question, e.context, e.answer)], 400)
    return write_family_checkpoint("qwen3_moe", tok, root / "qwen3_moe")


def moe_run(root: Path, checkpoint: Path, name: str, ep: int, *extra: str) -> dict:
    """The job of a created run of the MoE checkpoint at `ep` (4 steps planned; the job says how many it takes)."""
    spec, _ = create_run(load_spec("tiny", [
        *small_overrides(root / "runs"), f"model.path={checkpoint}", f"run.id={name}", "parallel.nproc_per_node=2",
        f"parallel.ep={ep}", "train.max_steps=4", "train.warmup_steps=0", "train.micro_batch_size=2",
        "train.global_batch_size=4", "train.seq_len=128", "checkpoint.async_save=false", *extra]))
    prepare(spec)
    (root / f"{name}.json").write_text(spec.model_dump_json())
    return {"spec": str(root / f"{name}.json"), "out": str(root / f"{name}-losses.json")}


def test_two_ranks_ep_1_and_2_equal_transformers_a_broken_dispatch_does_not_ep_2_trains_and_resumes_at_ep_1(
        tmp_path, capsys):
    checkpoint = qwen3_moe_checkpoint(tmp_path)
    ep1 = moe_run(tmp_path, checkpoint, "ep1", 1)
    ep2 = moe_run(tmp_path, checkpoint, "ep2", 2, "parallel.activation_checkpointing=full")  # the dispatch recomputed
    resumed = moe_run(tmp_path, checkpoint, "ep2to1", 1, f"checkpoint.resume_from={tmp_path / 'runs' / 'ep2'}")
    # LoRA on the attention, the routed experts (adapters per expert, sharded with their experts under ep 2) and the
    # routers
    expert_lora = ("model.lora.enabled=true", "model.lora.r=4",
                   "model.lora.target_modules=[q_proj,v_proj,experts,router]", "train.lr=1e-2")
    # the GPU default (bf16) with that LoRA at ep 2 (frozen experts in bf16, their adapters fp32 in the same FSDP
    # group): two steps, the fp32 run's losses to bf16 precision (adapters start at zero: the first is the base's)
    bf16_lora = moe_run(tmp_path, checkpoint, "ep2bf16lora", 2, "train.precision=bf16", *expert_lora)
    lora_1, lora_2 = (moe_run(tmp_path, checkpoint, f"expert-lora-ep{ep}", ep, *expert_lora) for ep in (1, 2))
    lora_grown = moe_run(tmp_path, checkpoint, "expert-lora-1to2", 2, *expert_lora,
                         f"checkpoint.resume_from={tmp_path / 'runs' / 'expert-lora-ep1'}")  # its adapters resharded
    # ep 1's step-3 checkpoint resumed at ep 2 (its experts resharded from FSDP's dim 0 to ep's)
    grown = moe_run(tmp_path, checkpoint, "ep1to2", 2, f"checkpoint.resume_from={tmp_path / 'runs' / 'ep1'}")
    # a capacity factor that drops (1.0: an expert busier than the mean loses copies) at ep 1 and at ep 2, where the
    # copies are dropped before the dispatch (and selective activation checkpointing's recomputation, which saves the
    # matmuls and runs the dispatch again, must not count them again)
    capped_1, capped_2 = (moe_run(tmp_path, checkpoint, f"capacity-ep{ep}", ep, "train.expert_capacity_factor=1.0",
                                  *extra)
                          for ep, extra in ((1, ()), (2, ("parallel.activation_checkpointing=selective",))))
    # auxiliary-loss-free balancing (router biases, 0.05 a step: large enough to move the choice at once) at ep 1 and
    # 2, and ep 1's step-2 checkpoint (its biases in it) resumed at ep 2
    bias = "train.router_bias_update_rate=0.05"
    biased_1, biased_2 = (moe_run(tmp_path, checkpoint, f"bias-ep{ep}", ep, bias) for ep in (1, 2))
    biased_grown = moe_run(tmp_path, checkpoint, "bias-1to2", 2, bias,
                           f"checkpoint.resume_from={tmp_path / 'runs' / 'bias-ep1'}")
    # the GPU default (bf16) at ep 2 with all three: a capacity that drops, router biases and the router z-loss
    # (coefficient 0.1: it adds ~25 % to the loss, far beyond bf16's tolerance), under selective activation
    # checkpointing, beside the same run in fp32
    capped_biased_z = ("train.expert_capacity_factor=1.0", bias, "train.router_z_loss_coef=0.1",
                       "parallel.activation_checkpointing=selective")
    bf16_capped_biased, fp32_capped_biased = (moe_run(tmp_path, checkpoint, f"ep2{precision}capbiasz", 2,
                                                      f"train.precision={precision}", *capped_biased_z)
                                              for precision in ("bf16", "fp32"))
    launch(tmp_path, 2, [{"oracle": 1, "out": str(tmp_path / "ep1.out")},
                         {"oracle": 2, "out": str(tmp_path / "ep2.out")},
                         {"oracle": 2, "aux": True, "out": str(tmp_path / "ep2aux.out")},
                         {"oracle": 2, "family": "mixtral", "z": True, "out": str(tmp_path / "mixtral-ep2z.out")},
                         {"oracle": 2, "lora": True, "out": str(tmp_path / "ep2lora.out")},
                         {"oracle": 2, "family": "qwen2_moe", "aux": True,
                          "out": str(tmp_path / "qwen2_moe-ep2aux.out")},
                         *({"oracle": 2, "broken": part, "out": str(tmp_path / f"broken-{part}.out")}
                           for part in ("dispatch", "combine")),
                         {**ep1, "steps": 4, "save_at": 3}, {**ep2, "steps": 3, "save": True},
                         {**resumed, "steps": 1}, {**grown, "steps": 1}, {**bf16_lora, "steps": 2},
                         {**lora_1, "steps": 3, "save_at": 2}, {**lora_2, "steps": 3}, {**lora_grown, "steps": 1},
                         {**capped_1, "steps": 2}, {**capped_2, "steps": 2}, {**biased_1, "steps": 3, "save_at": 2},
                         {**biased_2, "steps": 3}, {**biased_grown, "steps": 1}, {**bf16_capped_biased, "steps": 2},
                         {**fp32_capped_biased, "steps": 2}])
    for case, placements in (("ep1", ["S(0)"]), ("ep2", ["S(1)", "S(0)"]), ("ep2aux", ["S(1)", "S(0)"]),
                             ("mixtral-ep2z", ["S(1)", "S(0)"]), ("ep2lora", ["S(1)", "S(0)"]),
                             ("qwen2_moe-ep2aux", ["S(1)", "S(0)"])):
        loss, grad, placed = oracle_result(tmp_path / f"{case}.out")
        print(f"{case}: |loss - transformers'| {loss:.2e}, largest gradient difference {grad:.2e}")
        assert loss < LOSS_TOL and grad < GRAD_TOL and placed == placements, (case, loss, grad, placed)
    for part, what in (("dispatch", "a dispatch off by one rank"), ("combine", "a combine without the weights")):
        loss, grad, _ = oracle_result(tmp_path / f"broken-{part}.out")
        print(f"{what}: |loss - transformers'| {loss:.3f}, largest gradient difference {grad:.3f}")
        assert loss > 1e-2 and grad > 1e-2, part
    records = {job["out"]: json.loads(Path(job["out"]).read_text()) for job in (ep1, ep2, resumed, grown)}
    at_1, at_2, then_1, then_2 = ([r["loss"] for r in records[job["out"]]] for job in (ep1, ep2, resumed, grown))
    print(f"Trainer losses, ep 1: {at_1}; ep 2: {at_2}; its checkpoint resumed at ep 1: {then_1}; ep 1's resumed "
          f"at ep 2: {then_2}")
    assert at_2 == pytest.approx(at_1[:3], rel=1e-5) and then_1 == pytest.approx(at_1[3:], rel=1e-5)
    assert then_2 == pytest.approx(at_1[3:], rel=1e-5)
    # the step records count every routed copy of the global batch: 2 layers × top-2 × 4 rows × 128 positions
    loads = [[r["expert_tokens"] for r in records[job["out"]]] for job in (ep1, ep2)]
    print(f"tokens per expert, step 1: {loads[0][0]}, max/mean {records[ep1['out']][0]['expert_imbalance']:.2f}")
    assert loads[1] == loads[0][:3] and all(sum(step) == 2 * 2 * 4 * 128 for step in loads[0])
    assert all(r["expert_imbalance"] >= 1 for r in records[ep2["out"]])
    assert all(r["expert_dropped"] is None for r in records[ep1["out"]])  # no factor: nothing dropped, no field
    capped = [json.loads(Path(job["out"]).read_text()) for job in (capped_1, capped_2)]
    print(f"capacity factor 1.0, ep 1: losses {[r['loss'] for r in capped[0]]}, dropped copies "
          f"{[r['expert_dropped'] for r in capped[0]]}; ep 2: losses {[r['loss'] for r in capped[1]]}, dropped "
          f"{[r['expert_dropped'] for r in capped[1]]} (of 2 layers × top-2 × 4 rows × 128 positions a step)")
    assert [r["loss"] for r in capped[1]] == pytest.approx([r["loss"] for r in capped[0]], rel=1e-5)
    assert [r["expert_dropped"] for r in capped[1]] == [r["expert_dropped"] for r in capped[0]]
    assert all(r["expert_dropped"] > 0 for r in capped[0])
    # the routers' choice counted, dropped copies too: every routed copy of the global batch
    assert all(sum(r["expert_tokens"]) == 2 * 2 * 4 * 128 for r in capped[0] + capped[1])
    assert abs(capped[0][0]["loss"] - at_1[0]) > 1e-4  # the dropped copies changed the loss
    assert capped[1][0]["blocks"]["selective"] == capped[1][0]["blocks"]["blocks"] == 2, capped[1][0]["blocks"]
    biased = [json.loads(Path(job["out"]).read_text()) for job in (biased_1, biased_2, biased_grown)]
    print(f"router biases (rate 0.05), ep 1: losses {[r['loss'] for r in biased[0]]}, imbalance "
          f"{[round(r['expert_imbalance'], 3) for r in biased[0]]}; ep 2: {[r['loss'] for r in biased[1]]}; ep 1's "
          f"step 2 resumed at ep 2: {[r['loss'] for r in biased[2]]} (without biases: {at_1[:3]})")
    assert [r["loss"] for r in biased[1]] == pytest.approx([r["loss"] for r in biased[0]], rel=1e-5)
    assert [r["expert_tokens"] for r in biased[1]] == [r["expert_tokens"] for r in biased[0]]
    assert [r["loss"] for r in biased[2]] == pytest.approx([biased[0][2]["loss"]], rel=1e-5)
    assert biased[0][0]["loss"] == pytest.approx(at_1[0], rel=1e-6)  # the biases start at zero
    assert biased[0][1]["expert_tokens"] != loads[0][1]  # then steer the choice
    # transformers' routers have no bias: `shardline export` of ep 1's step-2 checkpoint says what it leaves out
    from shardline.cli import main  # in this process: its imports are paid already

    capsys.readouterr()
    assert main(["export", str(tmp_path / "runs" / "bias-ep1"), "--out", str(tmp_path / "bias-hf")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    print(said)
    found = re.search(r"warning: the checkpoint of step 2 routes with router biases \(train.router_bias_update_rate: "
                      r"max \|bias\| ([0-9.e-]+), .* over 2 layers × 8 experts\) that the export leaves out", said)
    # two updates of at most 0.05 · (1 + 7/8) each (a sign, centred over the 8 experts)
    assert found and 0 < float(found[1]) <= 2 * 0.05 * (1 + 7 / 8), said
    assert "plain top-k" in said
    recorded = json.loads((tmp_path / "bias-hf" / "shardline_export.json").read_text())["warnings"]
    assert len(recorded) == 1 and f"warning: {' '.join(recorded[0].split())}" in said, recorded  # kept with it
    every, every_fp32 = (json.loads(Path(job["out"]).read_text()) for job in (bf16_capped_biased, fp32_capped_biased))
    print(f"ep 2, capacity 1.0, router biases and z-loss 0.1: bf16 losses {[r['loss'] for r in every]}, dropped "
          f"{[r['expert_dropped'] for r in every]}; fp32 {[r['loss'] for r in every_fp32]} (fp32 capped without the "
          f"z-loss: {[r['loss'] for r in capped[0]]})")
    assert [r["loss"] for r in every] == pytest.approx([r["loss"] for r in every_fp32], rel=2e-2)
    assert all(r["expert_dropped"] > 0 for r in every) and every[0]["blocks"]["selective"] == 2
    # the biases are zero at step 1: the z-loss alone is what separates it from the capped run, beyond bf16's tolerance
    assert every_fp32[0]["loss"] - capped[0][0]["loss"] > 2e-2 * capped[0][0]["loss"]
    lora_at_1, lora_at_2 = ([r["loss"] for r in json.loads(Path(job["out"]).read_text())] for job in (lora_1, lora_2))
    lora_then_2 = [r["loss"] for r in json.loads(Path(lora_grown["out"]).read_text())]
    print(f"LoRA on the attention, the experts and the routers, ep 1: {lora_at_1}; ep 2: {lora_at_2}; ep 1's step 2 "
          f"resumed at ep 2: {lora_then_2}")
    assert lora_at_2 == pytest.approx(lora_at_1, rel=1e-5) and lora_at_1[0] == pytest.approx(at_1[0], rel=1e-6)
    assert lora_then_2 == pytest.approx(lora_at_1[2:], rel=1e-5)
    assert lora_at_1[2] < lora_at_1[1] < lora_at_1[0]
    bf16 = [r["loss"] for r in json.loads(Path(bf16_lora["out"]).read_text())]
    print(f"ep 2, bf16, LoRA on the attention, the experts and the routers: losses {bf16} (fp32 ep 1: {lora_at_1[:2]})")
    assert bf16 == pytest.approx(lora_at_1[:2], rel=2e-2) and bf16[1] < bf16[0]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_transformers_mixture_trains_from_the_cli_at_ep_2_retrains_a_killed_step_bit_exact_and_exports(
        tmp_path, capsys, family):
    examples = generate_splits(5, 300, 10, 10)["train"]
    tok = train_bpe([t for e in examples for t in (e.question, e.context, e.answer)], 400)
    checkpoint = write_checkpoint(family, tok, tmp_path / family)  # 8 experts, top-2, per-expert keys
    runs = tmp_path / "runs"
    sets = [*small_overrides(runs), f"model.path={checkpoint}", "parallel.nproc_per_node=2", "parallel.ep=2",
            "train.max_steps=4", "train.warmup_steps=0", "train.micro_batch_size=2", "train.global_batch_size=4",
            "train.seq_len=128", "checkpoint.every_steps=2", "checkpoint.async_save=false", "launch.max_restarts=1"]
    # rank 1 stops itself before step 4 (its first start only) and is killed with SIGKILL there: step 2 is the last
    # committed checkpoint, so torchrun's restart trains step 3 again, then step 4
    with cli_in_background("train", "tiny", *[a for kv in sets for a in ("--set", kv)],
                           fault="train_step:rank=1:step=4:restart=0:action=stop") as proc:
        run = kill_the_stopped_worker(runs, proc, after_step=3)
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    setup = next(e for e in read_metrics(run, "event") if e["event"] == "setup")
    trained = read_metrics(run, "train")
    print(f"mesh {setup['mesh']}; losses {[(r['step'], r['loss']) for r in trained]}")
    assert setup["family"] == {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE"}[family]
    assert setup["expert_parallel_layers"] == 2  # both layers dispatch
    assert [r["step"] for r in trained] == [1, 2, 3, 3, 4]
    assert [e["step"] for e in read_metrics(run, "event") if e["event"] == "resume"] == [2]
    assert trained[3]["loss"] == trained[2]["loss"] and trained[3]["grad_norm"] == trained[2]["grad_norm"]
    assert trained[-1]["loss"] < trained[0]["loss"]
    # every routed copy of the global batch counted: 2 layers × top-2 × 4 rows × 128 positions
    assert all(sum(r["expert_tokens"]) == 2 * 2 * 4 * 128 and r["expert_imbalance"] >= 1 for r in trained)

    from shardline.cli import main  # in this process: its imports are paid already, a process would pay them again

    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "router biases" not in capsys.readouterr().out  # none trained: no warning
    with safe_open(checkpoint / "model.safetensors", "pt") as f, safe_open(tmp_path / "hf" / "model.safetensors",
                                                                              "pt") as g:
        # per expert: block_sparse_moe.experts.7.w3.weight (Mixtral), mlp.experts.7.gate_proj.weight (Qwen3-MoE)
        assert set(g.keys()) == set(f.keys())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    val = [r["val_loss"] for r in read_metrics(run, "eval") if "val_loss" in r][-1]
    with torch.no_grad():
        theirs = unpacked_loss(model, prepared_of_run(run))
    print(f"{family}: validation loss of the run {val}, of its export in transformers {theirs}")
    assert theirs == pytest.approx(val, rel=1e-5)


def test_fsdp_2_x_ep_2_and_hsdp_2_x_ep_2_on_four_ranks_equal_transformers(tmp_path):
    checkpoint = qwen3_moe_checkpoint(tmp_path)
    # a capacity that drops and router biases, one micro-batch row a rank: FSDP 4 (ep 1) and FSDP 2 × EP 2
    dropping = ("parallel.nproc_per_node=4", "train.micro_batch_size=1", "train.expert_capacity_factor=1.0",
                "train.router_bias_update_rate=0.05")
    capped = [{**moe_run(tmp_path, checkpoint, f"capbias-ep{ep}", ep, *dropping), "steps": 3} for ep in (1, 2)]
    launch(tmp_path, 4, [{"oracle": 2, "out": str(tmp_path / "fsdp2xep2.out")},
                         {"oracle": 2, "aux": True, "z": True, "out": str(tmp_path / "fsdp2xep2aux.out")},
                         {"oracle": 2, "replicate": 2, "out": str(tmp_path / "hsdp2xep2.out")},
                         {"oracle": 2, "lora": True, "out": str(tmp_path / "fsdp2xep2lora.out")}, *capped])
    for case, placements in (("fsdp2xep2", ["S(1)", "S(0)"]), ("fsdp2xep2aux", ["S(1)", "S(0)"]),
                             ("hsdp2xep2", ["R", "S(1)", "S(0)"]), ("fsdp2xep2lora", ["S(1)", "S(0)"])):
        loss, grad, placed = oracle_result(tmp_path / f"{case}.out")
        print(f"{case}: |loss - transformers'| {loss:.2e}, largest gradient difference {grad:.2e}")
        assert loss < LOSS_TOL and grad < GRAD_TOL and placed == placements, (case, placed)
    at_1, at_2 = (json.loads(Path(job["out"]).read_text()) for job in capped)
    print(f"capacity 1.0 and router biases on 4 ranks, FSDP 4: losses {[r['loss'] for r in at_1]}, dropped "
          f"{[r['expert_dropped'] for r in at_1]}; FSDP 2 × EP 2: {[r['loss'] for r in at_2]}, dropped "
          f"{[r['expert_dropped'] for r in at_2]}")
    assert [r["loss"] for r in at_2] == pytest.approx([r["loss"] for r in at_1], rel=1e-5)
    for field in ("expert_dropped", "expert_tokens"):  # the biases steer the same choice, the same copies dropped
        assert [r[field] for r in at_2] == [r[field] for r in at_1], field
    assert all(r["expert_dropped"] > 0 for r in at_1)


def test_what_expert_parallel_does_not_compose_with_is_a_named_error(tmp_path):
    base = [*small_overrides(tmp_path / "runs"), "parallel.nproc_per_node=4", "parallel.ep=2"]
    for extra, field in ((["parallel.tp=2"], "parallel.tp"), (["parallel.compile=true"], "parallel.compile")):
        with pytest.raises(SpecError, match=f"parallel.ep.*{field}"):
            load_spec("tiny", [*base, *extra])
    with pytest.raises(SpecError, match="does not divide the 4 data-parallel shard ranks"):
        load_spec("tiny", [*base[:-1], "parallel.ep=3"])
    moe = Qwen3MoeConfig(num_experts=8)
    check_expert_parallel(moe, 4)
    with pytest.raises(SpecError, match="does not divide the model's 8 routed experts"):
        check_expert_parallel(moe, 3)
    with pytest.raises(SpecError, match="no routed experts"):
        check_expert_parallel(Qwen3Config(), 2)
