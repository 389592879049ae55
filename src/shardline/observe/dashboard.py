"""The Grafana dashboard for training runs, built as data (`shardline observe render` writes its JSON).

Rows: training (loss, throughput, MFU, step-time breakdown, cost), hardware (GPU utilisation and memory
from DCGM exporter), reliability (checkpoints, restarts/resumes, pending pods from kube-state-metrics).
Variables: `datasource` (any Prometheus) and `run_id` (from shardline's own series).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardline.spec import JobSpec

DS = {"type": "prometheus", "uid": "${datasource}"}
RUN = 'run_id=~"$run_id"'


def _panel(pid: int, title: str, exprs: list[tuple[str, str]], unit: str, x: int, y: int, w: int = 12,
           h: int = 8, stack: bool = False, description: str = "") -> dict:
    custom = {"lineWidth": 1, "fillOpacity": 30 if stack else 0, "showPoints": "never"}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "id": pid, "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"datasource": DS, "refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(exprs)],
    }


def _row(pid: int, title: str, y: int) -> dict:
    return {"id": pid, "type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}}


def dashboard(spec: JobSpec) -> dict:
    pods = f"{spec.run.name}-.*"
    gpu = f'pod=~"{pods}"'
    mean_step = (f"rate(shardline_train_step_seconds_total{{{RUN}}}[$__rate_interval]) / "
                 f"rate(shardline_train_steps_total{{{RUN}}}[$__rate_interval])")
    mean_wait = (f"rate(shardline_train_data_wait_seconds_total{{{RUN}}}[$__rate_interval]) / "
                 f"rate(shardline_train_steps_total{{{RUN}}}[$__rate_interval])")
    panels = [
        _row(1, "Training", 0),
        _panel(2, "Loss", [(f"shardline_loss{{{RUN}}}", "train {{run_id}}"),
                           (f"shardline_val_loss{{{RUN}}}", "validation {{run_id}}")], "none", 0, 1),
        _panel(3, "Tokens/s per device", [(f"shardline_tokens_per_s_per_device{{{RUN}}}", "{{run_id}}"),
                                          (f"rate(shardline_train_tokens_total{{{RUN}}}[$__rate_interval]) / "
                                           f"on (run_id) shardline_world_size{{{RUN}}}", "{{run_id}} (rate)")],
               "short", 12, 1),
        _panel(4, "MFU", [(f"shardline_mfu{{{RUN}}}", "MFU {{run_id}}")], "percentunit", 0, 9,
               description="Model FLOPs utilisation against shardline_peak_tflops (the dense peak of the device)."),
        _panel(5, "Step time breakdown", [(f"{mean_step} - {mean_wait}", "compute + communication"),
                                          (mean_wait, "data wait")], "s", 12, 9, stack=True,
               description="Mean over the scrape window from the step-time and data-wait counters."),
        _panel(6, "Cost", [(f"shardline_cost_usd{{{RUN}}}", "run so far {{run_id}}"),
                           (f"shardline_cost_usd_per_1m_tokens{{{RUN}}}", "$ / 1M tokens {{run_id}}")],
               "currencyUSD", 0, 17),
        _panel(7, "Learning rate and gradient norm", [(f"shardline_lr{{{RUN}}}", "lr"),
                                                       (f"shardline_grad_norm{{{RUN}}}", "grad norm (pre-clip)")],
               "none", 12, 17),
        _row(8, "GPUs (DCGM exporter)", 25),
        _panel(9, "GPU utilisation", [(f"DCGM_FI_DEV_GPU_UTIL{{{gpu}}}", "{{Hostname}} gpu {{gpu}}")],
               "percent", 0, 26),
        _panel(10, "GPU memory used", [(f"DCGM_FI_DEV_FB_USED{{{gpu}}} * 1024 * 1024", "{{Hostname}} gpu {{gpu}}"),
                                       (f"shardline_mem_peak_bytes{{{RUN}}}", "rank 0 peak (shardline)")],
               "bytes", 12, 26),
        _row(11, "Reliability", 34),
        _panel(12, "Checkpoint save and stall", [(f"shardline_checkpoint_save_seconds{{{RUN}}}", "save → commit"),
                                                 (f"shardline_checkpoint_stall_seconds{{{RUN}}}", "training stall")],
               "s", 0, 35, w=8),
        _panel(13, "Restarts and resumes", [(f"shardline_restarts{{{RUN}}}", "torchrun restarts"),
                                            (f"shardline_resumes_total{{{RUN}}}", "resumes (run lifetime)"),
                                            (f"shardline_preemptions_total{{{RUN}}}", "preemptions")],
               "short", 8, 35, w=8),
        _panel(14, "Pending pods", [(f'sum(kube_pod_status_phase{{phase="Pending", pod=~"{pods}"}})', "pending"),
                                    (f'sum(kube_pod_status_phase{{phase="Running", pod=~"{pods}"}})', "running")],
               "short", 16, 35, w=8),
    ]
    return {
        "uid": "shardline-training", "title": "shardline training", "tags": ["shardline", "training"],
        "timezone": "utc", "schemaVersion": 39, "version": 1, "editable": True, "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "run_id", "type": "query", "datasource": DS, "label": "run",
             "query": {"query": "label_values(shardline_step, run_id)", "refId": "run_id"},
             "definition": "label_values(shardline_step, run_id)", "refresh": 2, "includeAll": True,
             "multi": True, "current": {"text": "All", "value": "$__all"}},
        ]},
        "annotations": {"list": [
            {"name": "checkpoints", "datasource": DS, "enable": True, "iconColor": "blue",
             "expr": f"changes(shardline_checkpoint_last_step{{{RUN}}}[1m]) > 0"},
            {"name": "restarts", "datasource": DS, "enable": True, "iconColor": "red",
             "expr": f"changes(shardline_worker_start_time_seconds{{{RUN}}}[1m]) > 0"},
        ]},
        "panels": panels,
    }
