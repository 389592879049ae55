"""One short `shardline train` watched like production: a real Prometheus (Debian package) on loopback
scrapes rank 0 and evaluates the rendered alert rules; the run ends with its report, which headless
Chromium renders; TensorBoard and the cost fields carry the same numbers as metrics.jsonl."""

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from PIL import Image

from shardline.observe.render import ALERTS, render
from tests.conftest import free_port, only_run, read_metrics, run_cli, small_overrides, small_spec

PROMETHEUS, CHROMIUM = shutil.which("prometheus"), shutil.which("chromium")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None or CHROMIUM is None,
                                 reason="Debian packages prometheus and chromium (scripts/apt-packages.txt)")]
USD_PER_DEVICE_HOUR = 1.8
STEPS = 6


def _get(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """Prometheus on loopback scraping the run's port every second, with the rendered alert rules loaded."""
    home = tmp_path_factory.mktemp("prometheus")
    metrics_port, port = free_port(), free_port()
    render(small_spec(home, "run.name=tiny"), home)
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [ALERTS],
              "scrape_configs": [{"job_name": "shardline",
                                  "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}]}
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (home / "prometheus.log").open("w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={home / 'prometheus.yml'}",
                             f"--storage.tsdb.path={home / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (home / "prometheus.log").read_text()
                time.sleep(0.2)
        yield url, metrics_port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def observed_run(prometheus, tmp_path_factory):
    _, metrics_port = prometheus
    runs = tmp_path_factory.mktemp("observed") / "runs"
    overrides = [*small_overrides(runs), f"train.max_steps={STEPS}", "train.eval_every=3", "checkpoint.every_steps=3",
                 "train.log_every=2", "train.eval_examples=2", "train.eval_max_new_tokens=16",
                 f"observe.metrics_port={metrics_port}", "observe.metrics_host=127.0.0.1",
                 "observe.metrics_linger_s=4", "observe.tensorboard=true",
                 f"cost.usd_per_device_hour={USD_PER_DEVICE_HOUR}", "observe.report=true"]
    out = run_cli("train", "--nproc", "2", *[a for o in overrides for a in ("--set", o)], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return only_run(runs), out.stdout


def _query(url: str, promql: str) -> dict[str, float]:
    """Instant query → {run_id or '' : value}."""
    body = _get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
    assert body["status"] == "success", body
    return {r["metric"].get("run_id", ""): float(r["value"][1]) for r in body["data"]["result"]}


def test_prometheus_scraped_the_training_metrics(prometheus, observed_run):
    url, _ = prometheus
    run_dir, _ = observed_run
    run_id = run_dir.name
    train = read_metrics(run_dir, "train")
    # the endpoint is gone now: read the last sample each series had (range vectors skip staleness markers)
    deadline = time.monotonic() + 20
    while _query(url, "last_over_time(shardline_step[10m])").get(run_id) != STEPS:
        assert time.monotonic() < deadline, _get(f"{url}/api/v1/targets")
        time.sleep(0.5)

    def last(selector: str) -> float:
        name, _, labels = selector.partition("{")
        labels = ",".join(filter(None, [f'run_id="{run_id}"', labels.rstrip("}")]))
        return _query(url, f"last_over_time({name}{{{labels}}}[10m])")[run_id]

    assert last("shardline_loss") == pytest.approx(train[-1]["loss"], rel=1e-9)
    assert last("shardline_grad_norm") == pytest.approx(train[-1]["grad_norm"], rel=1e-9)
    assert last("shardline_train_tokens_total") == sum(r["tokens_total"] for r in train)
    assert last("shardline_train_steps_total") == STEPS
    assert last("shardline_checkpoints_total") == 2 and last("shardline_checkpoint_last_step") == STEPS
    assert last("shardline_checkpoint_save_seconds") > 0
    assert last("shardline_cost_usd") == pytest.approx(train[-1]["cost_usd"], rel=1e-9)
    assert last("shardline_usd_per_device_hour") == USD_PER_DEVICE_HOUR and last("shardline_world_size") == 2
    assert last('shardline_run_status{shardline_run_status="finished"}') == 1  # scraped while lingering
    goodput = [e for e in read_metrics(run_dir, "event") if e["event"] == "goodput"][-1]  # the final one
    assert 0 < last("shardline_goodput_ratio") == pytest.approx(goodput["ratio"], rel=1e-9)
    assert last('shardline_badput_seconds{bucket="startup"}') == pytest.approx(goodput["buckets"]["startup"])
    assert _query(url, 'max_over_time(up{job="shardline"}[10m])') == {"": 1.0}
    # the rendered rules load and evaluate against real series without errors
    groups = _get(f"{url}/api/v1/rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 7 and all(r["health"] == "ok" for r in rules), rules


def test_step_records_summary_and_console_carry_the_cost(observed_run):
    run_dir, stdout = observed_run
    train = read_metrics(run_dir, "train")
    assert all(r["cost_usd_step"] == pytest.approx(r["step_time_s"] * 2 * USD_PER_DEVICE_HOUR / 3600) for r in train)
    assert all(r["cost_usd_per_1m_tokens"] > 0 for r in train)
    assert [r["cost_usd"] for r in train] == sorted(r["cost_usd"] for r in train)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["cost_usd_total"] >= train[-1]["cost_usd"] and summary["price_source"] == "cost.usd_per_device_hour"
    assert "/step $" in stdout and "/1M tok" in stdout and "cost: $" in stdout and "in total" in stdout
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["metrics_url"].startswith("http://127.0.0.1:")


def test_tensorboard_has_the_losses_of_metrics_jsonl(observed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = observed_run
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in read_metrics(run_dir, "train")]
    assert acc.Scalars("eval/val_loss")


def test_the_report_written_at_the_end_of_train_shows_its_plots_in_chromium(observed_run):
    run_dir, stdout = observed_run
    page = run_dir / "report" / "index.html"
    assert f"report: {page}" in stdout  # written by rank 0 right after training
    html = page.read_text()
    assert "finished" in html and "SQL execution accuracy" in html and "question" in html
    shot = run_dir / "report" / "screenshot.png"
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={run_dir / 'chromium-profile'}", "--window-size=1200,1400",
                          f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and shot.is_file(), out.stderr[-2000:]
    with Image.open(shot) as im:
        im = im.convert("RGB")
        assert im.size == (1200, 1400)
        colors = im.getcolors(1 << 24)
        assert len(colors) > 500  # text, tables and plots, not a blank or error page
        counts = {rgb: n for n, rgb in colors}
        # matplotlib's default line colours, drawn by the plots (loss: tab:blue; validation: tab:orange)
        assert _near(counts, (31, 119, 180)) > 200 and _near(counts, (255, 127, 14)) > 20
        plots = im.crop((0, 500, 1200, 1400))
        assert len(plots.getcolors(1 << 24)) > 300


def _near(counts: dict, rgb: tuple[int, int, int], tol: int = 12) -> int:
    return sum(n for c, n in counts.items() if all(abs(a - b) <= tol for a, b in zip(c, rgb, strict=True)))

