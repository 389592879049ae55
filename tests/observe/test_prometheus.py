"""The metrics endpoint: names derived from the record fields, values from records, and never fatal."""

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from shardline.observe.prometheus import (
    TRAIN_COUNTERS,
    TRAIN_GAUGES,
    Endpoint,
    PrometheusSink,
    metric_name,
    pod_monitoring,
    scrape_annotations,
    serve,
)
from shardline.observe.session import observing
from shardline.rundir import read_manifest, write_manifest
from shardline.training.metrics import MetricsWriter
from tests.conftest import small_spec

DESIGN_TRAIN_FIELDS = ["step", "loss", "lr", "grad_norm", "tokens", "tokens_total", "step_time_s", "data_wait_s",
                       "tokens_per_s_per_device", "tflops_per_device", "mfu", "mem_peak_bytes", "cost_usd"]


def _samples(sink: PrometheusSink) -> dict[str, float]:
    text = generate_latest(sink.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = {k: v for k, v in s.labels.items() if k != "run_id"}
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else "")
            out[key] = s.value
    return out


def _train(step: int, **kw) -> dict:
    return {"step": step, "loss": 2.0 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens": 300, "tokens_total": 1000,
            "step_time_s": 0.5, "data_wait_s": 0.01, "tokens_per_s_per_device": 1000.0,
            "loss_tokens_per_s_per_device": 300.0, "tflops_per_device": 0.2, "mfu": 0.3, "mem_peak_bytes": 2**30,
            "epoch": 0.1, "time": 1000.0 + step, **kw}


def test_every_design_record_field_has_a_series_named_after_it():
    exported = set(TRAIN_GAUGES) | set(TRAIN_COUNTERS)
    assert set(DESIGN_TRAIN_FIELDS) <= exported
    assert metric_name("step_time_s") == "shardline_step_time_seconds"
    assert metric_name("mem_peak_bytes") == "shardline_mem_peak_bytes"


def test_records_become_gauges_and_counters():
    sink = PrometheusSink("run-1", {"run_name": "run"}, previous_resumes=2, max_steps=3)
    sink("event", {"event": "setup", "peak_tflops": 989.0, "world": 16})
    sink("train", _train(1))
    sink("train", _train(2, cost_usd=0.5, cost_usd_step=0.01, cost_usd_per_1m_tokens=10.0))
    sink("eval", {"step": 2, "val_loss": 0.9, "time": 1003.0})
    sink("event", {"event": "checkpoint", "step": 2, "stall_s": 1.5})
    sink("event", {"event": "checkpoint_committed", "step": 2, "save_s": 4.0, "time": 1004.0})
    sink("event", {"event": "resume", "step": 2, "time": 1005.0})
    sink("event", {"event": "preempted", "step": 2, "time": 1006.0})
    s = _samples(sink)
    assert s["shardline_step"] == 2 and s["shardline_loss"] == 1.0 and s["shardline_step_time_seconds"] == 0.5
    assert s["shardline_mem_peak_bytes"] == 2**30 and s["shardline_mfu"] == 0.3 and s["shardline_cost_usd"] == 0.5
    assert s["shardline_train_tokens_total"] == 2000 and s["shardline_train_loss_tokens_total"] == 600
    assert s["shardline_train_steps_total"] == 2 and s["shardline_train_step_seconds_total"] == 1.0
    assert s["shardline_val_loss"] == 0.9 and s["shardline_last_progress_timestamp_seconds"] == 1006.0
    assert s["shardline_last_step_timestamp_seconds"] == 1002.0
    assert s["shardline_checkpoint_stall_seconds"] == 1.5 and s["shardline_checkpoint_save_seconds"] == 4.0
    assert s["shardline_checkpoints_total"] == 1 and s["shardline_checkpoint_last_step"] == 2
    assert s["shardline_resumes_total"] == 3 and s["shardline_preemptions_total"] == 1  # 2 earlier + this one
    assert s["shardline_peak_tflops"] == 989.0 and s["shardline_world_size"] == 16
    assert s["shardline_run_status{shardline_run_status=running}"] == 1
    assert s["shardline_run_info{run_name=run}"] == 1
    sink("event", {"event": "goodput", "ratio": 0.8, "buckets": {"productive": 8.0, "startup": 1.5, "wasted": 0.5}})
    s = _samples(sink)
    assert s["shardline_goodput_ratio"] == 0.8 and s["shardline_badput_seconds{bucket=startup}"] == 1.5
    assert s["shardline_badput_seconds{bucket=wasted}"] == 0.5 and s["shardline_badput_seconds{bucket=eval}"] == 0
    assert "shardline_badput_seconds{bucket=productive}" not in s  # productive time is not badput
    sink("train", _train(3))  # the last step: the final evaluation follows, not more steps
    assert _samples(sink)["shardline_run_status{shardline_run_status=evaluating}"] == 1


def test_dpo_means_become_gauges_per_split():
    sink = PrometheusSink("run-1", {"run_name": "run"}, max_steps=3)
    pref = {"pairs": 8, "loss": 0.5, "accuracy": 0.75, "margin": 0.2, "prefers_chosen": 0.9}
    sink("train", _train(1, preference=pref))
    sink("eval", {"step": 1, "val_loss": 0.6, "val_preference": {**pref, "accuracy": 0.5}, "time": 1003.0})
    s = _samples(sink)
    assert s["shardline_dpo_accuracy{split=train}"] == 0.75 and s["shardline_dpo_accuracy{split=validation}"] == 0.5
    assert s["shardline_dpo_margin{split=train}"] == 0.2 and s["shardline_dpo_prefers_chosen{split=train}"] == 0.9
    sft = PrometheusSink("run-2", {"run_name": "run"}, max_steps=3)
    sft("train", _train(1, preference=None))
    assert not any(k.startswith("shardline_dpo_") for k in _samples(sft))


def test_grpo_means_become_gauges():
    sink = PrometheusSink("run-1", {"run_name": "run"}, max_steps=3)
    found = {"completions": 16, "reward": 0.42, "solved": 0.375, "zero_std": 0.25, "completion_length": 21.5,
             "truncated": 0.125, "kl": 0.003, "clipped": 0.0, "generation_s": 1.5, "reward_s": 0.02, "loss": 0.01}
    sink("train", _train(1, grpo=found))
    s = _samples(sink)
    assert s["shardline_grpo_reward"] == 0.42 and s["shardline_grpo_solved"] == 0.375
    assert s["shardline_grpo_completion_length"] == 21.5 and s["shardline_grpo_generation_s"] == 1.5
    sft = PrometheusSink("run-2", {"run_name": "run"}, max_steps=3)
    sft("train", _train(1))
    assert not any(k.startswith("shardline_grpo_") for k in _samples(sft))


def test_a_run_without_a_price_exports_no_cost_series():
    sink = PrometheusSink("run-2", {})
    sink("train", _train(1))
    assert not any(k.startswith("shardline_cost") for k in _samples(sink))


def test_endpoint_serves_on_the_configured_host_and_a_free_port():
    sink = PrometheusSink("run-3", {})
    sink("train", _train(7))
    endpoint, stop = serve(sink, "127.0.0.1", 0)
    try:
        assert endpoint.port > 0 and endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
        body = urllib.request.urlopen(endpoint.url, timeout=5).read().decode()
        assert 'shardline_step{run_id="run-3"} 7.0' in body
    finally:
        stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(endpoint.url, timeout=2)
    # bound to all interfaces, the endpoint is announced under this host's name (a pod's, in a cluster)
    assert Endpoint("0.0.0.0", 9405).url == f"http://{socket.gethostname()}:9405/metrics"


def test_a_failing_sink_is_dropped_and_training_records_still_written(tmp_path):
    writer = MetricsWriter(tmp_path / "metrics.jsonl", Console(quiet=True))
    seen = []

    def broken(kind, record):
        raise RuntimeError("tracker down")

    writer.sinks += [broken, lambda kind, record: seen.append(kind)]
    writer.write("train", _train(1))
    writer.write("eval", {"step": 1, "val_loss": 1.0})
    assert writer.sinks[-1] and len(writer.sinks) == 1 and seen == ["train", "eval"]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def _fake_trainer(tmp_path: Path, *overrides: str):
    spec = small_spec(tmp_path, "run.id=observed", *overrides)
    run_dir = tmp_path / "runs" / "observed"
    run_dir.mkdir(parents=True)
    write_manifest(run_dir, {"status": "running"})
    writer = MetricsWriter(run_dir / "metrics.jsonl", Console(quiet=True))
    ctx = SimpleNamespace(device=torch.device("cpu"), world=1, is_main=True)
    return spec, run_dir, SimpleNamespace(metrics=writer, ctx=ctx)


def test_a_taken_port_is_a_warning_not_a_failure(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spec, run_dir, trainer = _fake_trainer(tmp_path, f"observe.metrics_port={port}",
                                               "observe.metrics_host=127.0.0.1", "observe.report=false")
        console = Console(record=True, width=200)
        with observing(spec, run_dir, trainer, console):
            trainer.metrics.write("train", _train(1))
    assert "metrics endpoint not started" in console.export_text()
    manifest = read_manifest(run_dir)
    assert manifest["metrics_url"] is None and manifest["metrics_error"]
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1


def test_session_keeps_serving_the_final_status_for_the_linger_time(tmp_path):
    spec, run_dir, trainer = _fake_trainer(tmp_path, "observe.metrics_port=0", "observe.metrics_host=127.0.0.1",
                                           "observe.metrics_linger_s=2", "observe.report=false")
    bodies = []
    with observing(spec, run_dir, trainer, Console(quiet=True)):
        trainer.metrics.write("train", _train(1))
        url = read_manifest(run_dir)["metrics_url"]
        assert url.startswith("http://127.0.0.1:")
        assert 'shardline_step{run_id="observed"} 1.0' in urllib.request.urlopen(url, timeout=5).read().decode()
        write_manifest(run_dir, {"status": "finished"})  # as the worker does before leaving the block
        threading.Timer(1.0, lambda: bodies.append(urllib.request.urlopen(url, timeout=5).read().decode())).start()
        lingered = time.monotonic()
    assert time.monotonic() - lingered >= 2.0
    assert 'shardline_run_status{run_id="observed",shardline_run_status="finished"} 1.0' in bodies[0]
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_kubernetes_scrape_objects():
    assert scrape_annotations(9405) == {"prometheus.io/scrape": "true", "prometheus.io/port": "9405",
                                        "prometheus.io/path": "/metrics"}
    pm = pod_monitoring("ml")
    assert (pm["apiVersion"], pm["kind"]) == ("monitoring.googleapis.com/v1", "PodMonitoring")
    assert pm["metadata"]["namespace"] == "ml"
    # rank 0 only: the pod of completion index 0 of a shardline job; other ranks serve nothing
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "shardline",
                                                     "batch.kubernetes.io/job-completion-index": "0"}
    assert pm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    json.dumps(pm)


def test_a_bug_in_observing_never_stops_training(tmp_path, monkeypatch):
    import shardline.observe.session as session

    spec, run_dir, trainer = _fake_trainer(tmp_path, "observe.metrics_port=0", "observe.metrics_host=127.0.0.1")
    monkeypatch.setattr(session, "resolve_price", lambda *a: 1 / 0)
    console = Console(record=True, width=200)
    with observing(spec, run_dir, trainer, console):
        trainer.metrics.write("train", _train(1))
    assert "metrics, cost and report are off for this run" in console.export_text()
    assert trainer.metrics.cost is None and trainer.metrics.sinks == []


def test_a_local_run_serves_metrics_on_loopback_and_cluster_specs_on_all_interfaces(tmp_path):
    import socket

    spec, run_dir, trainer = _fake_trainer(tmp_path, "observe.metrics_port=0", "observe.report=false")
    assert spec.observe.metrics_host is None
    with observing(spec, run_dir, trainer, Console(quiet=True)):
        port = int(read_manifest(run_dir)["metrics_url"].rsplit(":", 1)[1].split("/")[0])
        with socket.socket() as s:  # the port is free on another address: bound to 127.0.0.1, not to all
            s.bind(("127.0.0.2", port))
    from shardline.engines.registry import get_backend

    cluster = spec.model_copy(deep=True)
    cluster.launch.image = "registry.example/shardline:1"
    for target in ("slurm", "jobset", "ray"):
        files = get_backend(target).render(cluster)
        assert any("metrics_host: 0.0.0.0" in text for text in files.values()), target
