"""Alert rules and the dashboard: valid for promtool, firing on synthetic series, querying real series."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shardline.cli import main
from shardline.observe.alerts import NCCL_TIMEOUT_PATTERN, prometheus_rules
from shardline.observe.prometheus import PrometheusSink
from shardline.observe.render import ALERTS, DASHBOARD, KUBERNETES_SCRAPE, LOG_ALERTS, PROMETHEUS_CONFIG
from tests.conftest import small_spec

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="Debian package prometheus (scripts/apt-packages.txt)")
EXTERNAL_SERIES = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "kube_pod_status_phase",
                   "kube_pod_container_status_restarts_total"}


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("observe")
    assert main(["observe", "render", "--set", "run.name=llama", "--out", str(out)]) == 0
    return out


@needs_promtool
def test_rendered_rules_and_config_pass_promtool(rendered):
    out = _promtool("check", "rules", str(rendered / ALERTS))
    assert out.returncode == 0 and "SUCCESS: 7 rules found" in out.stdout, out.stdout + out.stderr
    out = _promtool("check", "config", str(rendered / PROMETHEUS_CONFIG))
    assert out.returncode == 0, out.stdout + out.stderr


UNIT_TESTS = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # run a: stuck — its last record was at t=0 and the worker still serves "running"
      - series: 'shardline_last_progress_timestamp_seconds{{run_id="a"}}'
        values: '0x30'
      - series: 'shardline_run_status{{run_id="a", shardline_run_status="running"}}'
        values: '1x30'
      # run b: progressing — a record every minute
      - series: 'shardline_last_progress_timestamp_seconds{{run_id="b"}}'
        values: '0+60x30'
      - series: 'shardline_run_status{{run_id="b", shardline_run_status="running"}}'
        values: '1x30'
      # run c: finished an hour ago, still lingering: not stuck
      - series: 'shardline_last_progress_timestamp_seconds{{run_id="c"}}'
        values: '0x30'
      - series: 'shardline_run_status{{run_id="c", shardline_run_status="running"}}'
        values: '0x30'
      - series: 'shardline_checkpoint_save_seconds{{run_id="a"}}'
        values: '20x10 95x10'
      - series: 'shardline_worker_start_time_seconds{{run_id="a"}}'
        values: '100 100 400 400 700 700 1000 1000'
      # run a: the watchdog reported a hang at t=6m (exported from then on by the restarted worker)
      - series: 'shardline_last_hang_timestamp_seconds{{run_id="a"}}'
        values: '_x5 360x40'
      - series: 'kube_pod_status_phase{{namespace="ml", pod="llama-worker-0-0", phase="Pending"}}'
        values: '1x20'
      - series: 'kube_pod_status_phase{{namespace="ml", pod="other-job-0", phase="Pending"}}'
        values: '1x20'
      - series: 'DCGM_FI_DEV_GPU_UTIL{{namespace="ml", pod="llama-worker-0-0", Hostname="n1", gpu="0"}}'
        values: '20x20'
      - series: 'DCGM_FI_DEV_GPU_UTIL{{namespace="ml", pod="llama-worker-0-0", Hostname="n1", gpu="1"}}'
        values: '95x20'
    alert_rule_test:
      - eval_time: 10m
        alertname: ShardlineNoProgress
      - eval_time: 16m
        alertname: ShardlineNoProgress
        exp_alerts:
          - exp_labels: {{severity: critical, run_id: a}}
            exp_annotations:
              summary: Run a made no progress for 15m
              description: "{no_progress}"
      - eval_time: 5m
        alertname: ShardlineCheckpointExceedsGrace
      - eval_time: 12m
        alertname: ShardlineCheckpointExceedsGrace
        exp_alerts:
          - exp_labels: {{severity: critical, run_id: a}}
            exp_annotations:
              summary: Checkpoint of a took 1m 35s
              description: "{grace}"
      - eval_time: 7m
        alertname: ShardlineRestartLoop
        exp_alerts:
          - exp_labels: {{severity: critical, run_id: a}}
            exp_annotations:
              summary: Training restarts in a loop
              description: "{restart}"
      - eval_time: 3m
        alertname: ShardlineRankHung
      - eval_time: 20m
        alertname: ShardlineRankHung
        exp_alerts:
          - exp_labels: {{severity: critical, run_id: a}}
            exp_annotations:
              summary: A rank of a hung
              description: "{hang}"
      - eval_time: 37m
        alertname: ShardlineRankHung
      - eval_time: 9m
        alertname: ShardlinePodPending
      - eval_time: 11m
        alertname: ShardlinePodPending
        exp_alerts:
          - exp_labels: {{severity: warning, namespace: ml, pod: llama-worker-0-0}}
            exp_annotations:
              summary: Pod ml/llama-worker-0-0 pending for over 10m
              description: "{pending}"
      - eval_time: 14m
        alertname: ShardlineGPUUtilizationLow
      - eval_time: 16m
        alertname: ShardlineGPUUtilizationLow
        exp_alerts:
          - exp_labels: {{severity: warning, namespace: ml, pod: llama-worker-0-0, Hostname: n1, gpu: "0"}}
            exp_annotations:
              summary: GPU 0 of llama-worker-0-0 below 40% for 15m
              description: "{gpu}"
"""


@needs_promtool
def test_alerts_fire_on_synthetic_series_and_only_then(rendered, tmp_path):
    """promtool's rule unit tests: each alert stays silent before its condition has held long enough and
    fires afterwards for the matching series only (the other job's pod, the busy GPU, the progressing and
    the finished runs stay silent)."""
    rules = {r["alert"]: r["annotations"]["description"]
             for r in yaml.safe_load((rendered / ALERTS).read_text())["groups"][0]["rules"]}
    text = UNIT_TESTS.format(rules=json.dumps(str(rendered / ALERTS)), no_progress=rules["ShardlineNoProgress"],
                             grace=rules["ShardlineCheckpointExceedsGrace"], restart=rules["ShardlineRestartLoop"],
                             pending=rules["ShardlinePodPending"], gpu=rules["ShardlineGPUUtilizationLow"],
                             hang=rules["ShardlineRankHung"])
    tests = tmp_path / "alerts.test.yaml"
    tests.write_text(text)
    out = _promtool("test", "rules", str(tests))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_thresholds_come_from_the_spec():
    spec = small_spec(Path("/tmp"), "observe.no_progress_minutes=5", "launch.grace_seconds=120",
                      "run.name=big-job")
    rules = {r.alert: r for r in prometheus_rules(spec)}
    assert "> 300" in rules["ShardlineNoProgress"].expr and "5m" in rules["ShardlineNoProgress"].summary
    assert rules["ShardlineCheckpointExceedsGrace"].expr == "shardline_checkpoint_save_seconds > 120"
    assert 'pod=~"big-job-.*"' in rules["ShardlinePodPending"].expr
    assert rules["ShardlineGPUUtilizationLow"].for_ == "15m" and "< 40" in rules["ShardlineGPUUtilizationLow"].expr


REAL_TIMEOUT_LINES = [
    "[rank3]:[E1122 04:11:12.123456 1234 ProcessGroupNCCL.cpp:616] [Rank 3] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=1042, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600074 "
    "milliseconds before timing out.",
    "[rank0]:[E1122 04:21:12.000000 77 ProcessGroupNCCL.cpp:1664] [PG ID 0 PG GUID 0(default_pg) Rank 0] "
    "Exception (either an error or timeout) detected by watchdog at work: 1042, last enqueued NCCL work: 1043",
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for "
    "recv operation to complete",
]
ORDINARY_LINES = ["NCCL INFO Channel 00/32 : 0[0] -> 1[1] via P2P/CUMEM", "step   100/300  loss  0.4210",
                  "checkpoint step 100: training stalled 1.20s (written)"]


def test_nccl_timeout_log_pattern_matches_watchdog_lines_only(rendered):
    pattern = re.compile(NCCL_TIMEOUT_PATTERN)
    assert all(pattern.search(line) for line in REAL_TIMEOUT_LINES)
    assert not any(pattern.search(line) for line in ORDINARY_LINES)
    rule = yaml.safe_load((rendered / LOG_ALERTS).read_text())["groups"][0]["rules"][0]
    assert rule["alert"] == "ShardlineNCCLTimeout" and "count_over_time" in rule["expr"]
    assert NCCL_TIMEOUT_PATTERN in rule["expr"] and 'pod=~"llama-.*"' in rule["expr"]


def _exported_names() -> set[str]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    sink = PrometheusSink("r", {})
    sink("event", {"event": "setup", "peak_tflops": 1.0, "world": 1})
    sink("train", {"step": 1, "loss": 1.0, "lr": 1.0, "grad_norm": 1.0, "tokens": 1, "tokens_total": 1,
                   "step_time_s": 1.0, "data_wait_s": 0.1, "tokens_per_s_per_device": 1.0,
                   "loss_tokens_per_s_per_device": 1.0, "tflops_per_device": 1.0, "mfu": 0.1, "mem_peak_bytes": 1,
                   "epoch": 0.1, "cost_usd": 1.0, "cost_usd_step": 1.0, "cost_usd_per_1m_tokens": 1.0})
    sink("eval", {"step": 1, "val_loss": 1.0, "sql_execution_accuracy": 0.5, "sql_exact_match": 0.5})
    sink("event", {"event": "checkpoint", "step": 1, "stall_s": 1.0})
    sink("event", {"event": "checkpoint_committed", "step": 1, "save_s": 1.0})
    sink("event", {"event": "hang", "ranks": [1]})
    sink.set_price(1.0)
    text = generate_latest(sink.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _series_in(expr: str) -> set[str]:
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[|\)|\s*[<>=*/+-]|$)", expr))
    return {n for n in names if n.startswith(("shardline_", "DCGM_", "kube_"))}


def test_dashboard_and_rules_query_only_series_that_exist(rendered):
    exported = _exported_names()
    board = json.loads((rendered / DASHBOARD).read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board["annotations"]["list"]]
    exprs += [r["expr"] for r in yaml.safe_load((rendered / ALERTS).read_text())["groups"][0]["rules"]]
    used = set().union(*map(_series_in, exprs))
    assert {"shardline_loss", "shardline_mfu", "DCGM_FI_DEV_GPU_UTIL", "kube_pod_status_phase",
            "shardline_checkpoint_save_seconds", "shardline_cost_usd"} <= used
    unknown = {n for n in used if n not in exported and n not in EXTERNAL_SERIES}
    assert unknown == set()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["templating"]["list"][1]["name"] == "run_id"
    titles = {p["title"] for p in board["panels"]}
    assert {"Loss", "Step time breakdown", "GPU utilisation", "GPU memory used", "Checkpoint save and stall",
            "Pending pods", "Cost"} <= titles


def test_kubernetes_scrape_job_keeps_annotated_pods(rendered):
    (job,) = yaml.safe_load((rendered / KUBERNETES_SCRAPE).read_text())
    keep = job["relabel_configs"][0]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}] and keep["action"] == "keep"
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    rank0 = {r["source_labels"][0]: re.compile(r["regex"]) for r in job["relabel_configs"][1:3]}
    for regex in rank0.values():  # Prometheus anchors relabel regexes: node 0's pod and label-less pods only
        assert regex.fullmatch("0") and regex.fullmatch("") and not regex.fullmatch("1")
