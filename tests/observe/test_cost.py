"""Cost: one price table, spec overrides, the plan projection and the per-step meter."""

import json
from pathlib import Path

import pytest

from shardline.cli import main
from shardline.errors import SpecError
from shardline.hardware import PROVISIONING
from shardline.planning.cost import (
    CostMeter,
    Price,
    device_key,
    estimated_step_time,
    previous_cost_usd,
    price_table,
    project_cost,
    resolve_price,
)
from shardline.spec.resolve import load_spec
from tests.conftest import small_spec

TMP = Path("/tmp")
TABLE = price_table(small_spec(TMP))


def test_price_table_has_the_gcp_gpus_and_every_provisioning_model():
    assert {"h100", "h200", "b200", "a100", "l4"} <= set(TABLE)
    for gpu, row in TABLE.items():
        assert tuple(row) == PROVISIONING, gpu
        # TPU flex-start is listed at the spot price (hardware.py); GPU flex-start lies between spot and on-demand
        assert row["spot"] <= row["dws-flex-start"] < row["on-demand"] and row["reservation"] < row["on-demand"]


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                       ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("NVIDIA H200", "h200"),
                                       ("cpu", None)])
def test_cuda_device_names_map_to_table_rows_by_whole_word(name, key):
    assert device_key(name) == key


def test_a_catalogued_gpu_without_a_table_price_asks_for_one():
    price = resolve_price(small_spec(TMP), "NVIDIA L40S")
    assert not price.known and "cost.prices.l40s.on-demand" in price.source
    priced = resolve_price(small_spec(TMP, "cost.prices={l40s: {on-demand: 1.8}}"), "NVIDIA L40S")
    assert (priced.usd_per_device_hour, priced.source) == (1.8, "cost.prices.l40s.on-demand")


def test_table_price_follows_device_and_provisioning():
    spec = small_spec(TMP, "cost.provisioning=spot")
    price = resolve_price(spec, "NVIDIA H100 80GB HBM3")
    assert price.usd_per_device_hour == TABLE["h100"]["spot"] and "h100 spot" in price.source
    pinned = resolve_price(small_spec(TMP, "cost.gpu=a100"), "NVIDIA H100 80GB HBM3")
    assert pinned.usd_per_device_hour == TABLE["a100"]["on-demand"]


def test_cpu_is_priced_only_by_the_spec():
    unpriced = resolve_price(small_spec(TMP), "cpu")
    assert not unpriced.known and "cost.usd_per_device_hour" in unpriced.source
    priced = resolve_price(small_spec(TMP, "cost.usd_per_device_hour=0.25"), "cpu")
    assert (priced.usd_per_device_hour, priced.source) == (0.25, "cost.usd_per_device_hour")
    # the override also beats the table on a GPU
    assert resolve_price(small_spec(TMP, "cost.usd_per_device_hour=1.5"), "h100").usd_per_device_hour == 1.5


def test_spec_prices_override_and_extend_the_table():
    spec = small_spec(TMP, "cost.provisioning=spot", "cost.prices={H100: {spot: 2.0}, mi300x: {spot: 1.25}}")
    h100 = resolve_price(spec, "h100")
    assert (h100.usd_per_device_hour, h100.source) == (2.0, "cost.prices.h100.spot")
    assert resolve_price(small_spec(TMP, "cost.gpu=mi300x", "cost.provisioning=spot",
                                    "cost.prices={mi300x: {spot: 1.25}}"), "cpu").usd_per_device_hour == 1.25


@pytest.mark.parametrize("overrides, field, words", [
    (["cost.gpu=tpu-v9"], "cost.gpu", ["'tpu-v9'", "cost.prices.tpu-v9"]),
    (["cost.prices={h100: {spot: -1}}"], "cost.prices.h100.spot", ["-1", "≥ 0"]),
    (["cost.gpu=mygpu", "cost.provisioning=spot", "cost.prices={mygpu: {on-demand: 1}}"], "cost.provisioning",
     ["no spot price for mygpu", "cost.prices.mygpu.spot"]),
    (["cost.provisioning=preemptible"], "cost.provisioning", ["'preemptible'"]),
    (["cost.assumed_mfu=1.5"], "cost.assumed_mfu", ["1.5"]),
])
def test_bad_cost_input_names_the_field_the_value_and_the_fix(overrides, field, words):
    with pytest.raises(SpecError) as err:
        small_spec(TMP, *overrides)
    assert err.value.where == field and err.value.fix
    text = f"{err.value.problem} {err.value.fix}"
    assert all(w in text for w in words), text


def test_meter_prices_each_step_and_the_run_so_far():
    meter = CostMeter(Price(3.6, "test"), devices=2, previous_usd=1.0, started=0.0)
    meter.started = __import__("time").monotonic() - 100  # 100 s of wall time on 2 devices at $3.6/h = $0.2
    fields = meter.on_step({"step_time_s": 0.5, "tokens_total": 1000})
    assert fields["cost_usd_step"] == pytest.approx(0.5 * 2 * 3.6 / 3600)
    assert fields["cost_usd_per_1m_tokens"] == pytest.approx(fields["cost_usd_step"] / 1000 * 1e6)
    assert fields["cost_usd"] == pytest.approx(1.2, abs=1e-3)
    summary = meter.summary()
    assert summary["cost_usd_total"] == pytest.approx(1.2, abs=1e-3) and summary["cost_devices"] == 2
    assert summary["cost_usd_per_1m_tokens"] == pytest.approx(1.2 / 1000 * 1e6, rel=1e-2)


def test_meter_without_a_price_adds_no_fields():
    meter = CostMeter(Price(None, "no price for cpu"), devices=2)
    assert meter.on_step({"step_time_s": 1.0, "tokens_total": 10}) == {}
    assert meter.summary()["cost_usd_total"] is None and "not tracked" in meter.describe()


def test_a_resumed_run_continues_from_the_cost_its_earlier_attempts_recorded(tmp_path):
    f = tmp_path / "metrics.jsonl"
    assert previous_cost_usd(f) == 0.0
    lines = [{"kind": "train", "step": 1, "cost_usd": 0.5}, {"kind": "eval", "val_loss": 1.0},
             {"kind": "train", "step": 2, "cost_usd": 0.75}]
    f.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "train", "cost_usd": 9')  # torn line
    assert previous_cost_usd(f) == 0.75


def test_projection_is_steps_times_step_time_times_devices_times_price():
    spec = load_spec("llama-3.1-70b-fsdp", ["cost.provisioning=spot"])
    step_s = estimated_step_time(spec, peak_tflops=989.0)
    p = project_cost(spec, "NVIDIA H100 80GB HBM3", step_s, "estimated")
    spot = TABLE["h100"]["spot"]
    assert p.total_usd == pytest.approx(spec.train.max_steps * step_s * spec.world_size / 3600 * spot)
    assert set(p.by_provisioning) == set(PROVISIONING) and p.by_provisioning["spot"] == pytest.approx(p.total_usd)
    # 70B: ~6 × 70e9 FLOPs per token (+ attention); 1024 rows × 512 tokens per step at 40 % of 989 TFLOP/s × 16
    rough = 6 * 70.6e9 * 1024 * 512 / (16 * 989e12 * 0.4)
    assert step_s == pytest.approx(rough, rel=0.05)
    faster = estimated_step_time(load_spec("llama-3.1-70b-fsdp", ["cost.assumed_mfu=0.8"]), 989.0)
    assert faster == pytest.approx(step_s / 2)


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err  # errors go to stderr


def test_plan_prints_the_projected_cost_estimated_and_measured(tmp_path, capsys):
    code, out = _cli(capsys, "plan", "llama-3.1-70b-fsdp", "--set", "cost.provisioning=spot")
    assert code == 0
    assert "time: 1500 steps ×" in out and "40% MFU (cost.assumed_mfu)" in out
    assert "table: b200 spot" in out and "by provisioning: on-demand $" in out  # the preset's a4 profile: B200
    run = tmp_path / "tiny-measured"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"mean_tokens_per_s_per_device": 1000.0}))
    code, out = _cli(capsys, "plan", "--set", "cost.usd_per_device_hour=3.6", "--set", "parallel.nproc_per_node=2",
                     "--from-run", str(run))
    assert code == 0
    # 16 rows × 256 tokens / (1000 tok/s × 2 devices) = 2.048 s/step; 500 steps × 2 devices × $3.6/h = $2.048
    assert "500 steps × 2.05 s/step" in out and "measured: 1,000 tok/s/device" in out
    assert "cost: $2.05 " in out, out
    code, out = _cli(capsys, "plan", "--from-run", str(tmp_path))
    assert code == 2 and "--from-run" in out
