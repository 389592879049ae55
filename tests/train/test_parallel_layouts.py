"""HSDP, CPU offload and activation-checkpointing policies change memory/layout, never the math."""

import pytest
from rich.console import Console
from torch.distributed.tensor import DTensor

from shardline.data.prepare import prepare
from shardline.errors import SpecError
from shardline.spec.resolve import load_spec
from shardline.training.trainer import Trainer
from tests.conftest import only_run, read_metrics, run_cli, small_overrides, small_spec


def _trainer(ctx, session_dir, prepared, *overrides) -> Trainer:
    spec = small_spec(session_dir, "train.precision=fp32", "train.peak_tflops=1", *overrides)
    return Trainer(spec, ctx, prepared, session_dir / "runs" / "layouts", Console(quiet=True))


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("every", [1, 2])
def test_activation_checkpointing_policies_keep_loss_and_gradients(ctx, session_dir, prepared, policy, every):
    plain = _trainer(ctx, session_dir, prepared)
    ac = _trainer(ctx, session_dir, prepared, f"parallel.activation_checkpointing={policy}",
                  f"parallel.activation_checkpointing_every={every}")
    wrapped = [layer.gradient_checkpointing for layer in ac.model.model.layers]
    assert wrapped == [i % every == 0 for i in range(len(wrapped))]
    r0, r1 = plain.train_step(), ac.train_step()
    assert r0.loss == pytest.approx(r1.loss, rel=1e-6) and r0.grad_norm == pytest.approx(r1.grad_norm, rel=1e-5)


def test_cpu_offload_keeps_state_on_the_host_and_trains_identically(ctx, session_dir, prepared):
    plain = _trainer(ctx, session_dir, prepared)
    off = _trainer(ctx, session_dir, prepared, "parallel.offload=true")
    state = off.model.model.layers[0]._get_fsdp_state()
    assert type(state._fsdp_param_group.offload_policy).__name__ == "CPUOffloadPolicy"
    r0, r1 = plain.train_step(), off.train_step()
    assert r0.loss == pytest.approx(r1.loss, rel=1e-6) and r0.grad_norm == pytest.approx(r1.grad_norm, rel=1e-5)
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in off.model.parameters())


def test_hsdp_layout_must_multiply_to_the_world_size(tmp_path):
    with pytest.raises(SpecError, match="dp_replicate × dp_shard"):
        load_spec("tiny", ["parallel.nproc_per_node=4", "parallel.dp_replicate=3", "train.global_batch_size=32"])
    spec = load_spec("tiny", ["parallel.nproc_per_node=4", "parallel.dp_replicate=2", "train.global_batch_size=32"])
    assert spec.world_size == 4


@pytest.mark.slow
def test_hsdp_2x2_matches_one_process_on_the_same_global_batch(ctx, tmp_path):
    """4 ranks through `shardline train` against one in-process rank that takes the same global batch in 4
    micro-batches."""
    common = ["train.precision=fp32", "train.max_steps=3", "train.micro_batch_size=2", "train.global_batch_size=8"]
    sets = [*small_overrides(tmp_path / "hsdp"), *common, "parallel.dp_replicate=2"]
    out = run_cli("train", *[a for s in sets for a in ("--set", s)], "--nproc", "4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = only_run(tmp_path / "hsdp")
    setup = next(e for e in read_metrics(run, "event") if e["event"] == "setup")
    assert setup["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    hsdp = read_metrics(run, "train")
    spec = load_spec("tiny", [*small_overrides(tmp_path / "one"), *common, "parallel.nproc_per_node=1"])
    one = Trainer(spec, ctx, prepare(spec), tmp_path / "one", Console(quiet=True))
    assert len(hsdp) == 3
    for record in hsdp:
        mine = one.train_step()
        assert mine.loss == pytest.approx(record["loss"], rel=1e-5, abs=1e-6)
        assert mine.grad_norm == pytest.approx(record["grad_norm"], rel=1e-4)
