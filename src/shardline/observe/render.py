"""`shardline observe render`: the alert rules, the Grafana dashboard and an example Prometheus config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from shardline.observe.alerts import log_rules, prometheus_rules, rule_file
from shardline.observe.dashboard import dashboard

if TYPE_CHECKING:
    from shardline.spec import JobSpec

ALERTS = "shardline-alerts.yaml"
LOG_ALERTS = "shardline-loki-alerts.yaml"
DASHBOARD = "grafana-dashboard.json"
PROMETHEUS_CONFIG = "prometheus.yml"
KUBERNETES_SCRAPE = "prometheus-kubernetes-scrape.yaml"


def prometheus_config(spec: JobSpec) -> dict:
    """A Prometheus config that loads the rules and scrapes a run on this machine."""
    port = spec.observe.metrics_port or 9405
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": [ALERTS],
        "scrape_configs": [
            {"job_name": "shardline-local", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]},
        ],
    }


def kubernetes_scrape_config() -> dict:
    """A scrape job (for `scrape_configs:`) for pods annotated `prometheus.io/scrape: "true"`
    (observe.prometheus.scrape_annotations), labelled with namespace and pod. Only global rank 0 serves, and
    a pod template's annotations are on every node's pod: keep the first node's pod only — completion index
    0 of an Indexed Job, and job index 0 of a JobSet (absent labels pass, for single pods)."""
    relabel = [
        {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "action": "keep",
         "regex": "true"},
        {"source_labels": ["__meta_kubernetes_pod_label_batch_kubernetes_io_job_completion_index"],
         "action": "keep", "regex": "0|"},
        {"source_labels": ["__meta_kubernetes_pod_label_jobset_sigs_k8s_io_job_index"], "action": "keep",
         "regex": "0|"},
        {"source_labels": ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"],
         "action": "replace", "regex": r"([^:]+)(?::\d+)?;(\d+)", "replacement": "$1:$2",
         "target_label": "__address__"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]
    return {"job_name": "shardline-pods", "kubernetes_sd_configs": [{"role": "pod"}], "relabel_configs": relabel}


def _yaml(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=200, allow_unicode=True)


def render(spec: JobSpec, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = {
        ALERTS: _yaml(rule_file("shardline", prometheus_rules(spec))),
        LOG_ALERTS: _yaml(rule_file("shardline-logs", log_rules(spec))),
        DASHBOARD: json.dumps(dashboard(spec), indent=2) + "\n",
        PROMETHEUS_CONFIG: _yaml(prometheus_config(spec)),
        KUBERNETES_SCRAPE: _yaml([kubernetes_scrape_config()]),
    }
    for name, text in files.items():
        (out / name).write_text(text)
    return [out / name for name in files]
