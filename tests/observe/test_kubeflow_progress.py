"""TrainJob progress (observe/kubeflow_progress.py) posted through the Kubeflow SDK's own update_trainjob_status to
the stand-in of Trainer's status endpoint (tests/launch/trainer_status_server.py: HTTPS on 127.0.0.1, CA, token,
schema) made slow, failing or left healthy: a training step never waits for a post, attempts keep to the interval
after failures too, a failure is logged once, and the final state reaches a healthy endpoint at close without a
broken one holding the exit."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable

import pytest

import tests.launch.kubeflow_sdk  # noqa: F401 - puts the SDK (.kubeflow-sdk/) on sys.path
from shardline.observe import kubeflow_progress
from shardline.observe.kubeflow_progress import POST_INTERVAL_S, KubeflowProgressSink
from tests.conftest import LOADED_SLACK_S
from tests.launch.http_json import send_json
from tests.launch.trainer_status_server import TrainerStatusServer

SDK_TIMEOUT_S = 5.0
"""The request timeout of the SDK's update_trainjob_status (kubeflow.trainer.backends.kubernetes.utils)."""
SERVER_DELAY_S = 8.0
"""Past the SDK's request timeout: what an endpoint answering after 30 s looks like to the SDK."""


@pytest.fixture
def update_trainjob_status(monkeypatch) -> Callable[..., bool]:
    """The SDK's poster, as in a fresh pod: the SDK keeps its throttle clock and token per process, and each test's
    stand-in is another controller with a token of its own."""
    from kubeflow.trainer import update_trainjob_status
    from kubeflow.trainer.backends.kubernetes import utils

    monkeypatch.setattr(utils, "_last_update_time", 0.0)
    monkeypatch.setattr(utils, "_cached_token", None)
    return update_trainjob_status


def _serve(tmp_path, monkeypatch, delay_s: float = 0.0, code: int | None = None) -> tuple[TrainerStatusServer, list]:
    """The stand-in, with the controller's variables set; each post waits `delay_s`, then is checked and recorded
    as usual or, with `code`, answered with that code. Returns the stand-in and every post's arrival (time, body)."""
    stand_in = TrainerStatusServer(tmp_path, "default", "shardline")
    checked = stand_in.server.RequestHandlerClass
    arrivals: list[tuple[float, dict]] = []
    taken_down = threading.Event()  # leaving `with stand_in` drops a delayed answer instead of waiting it out
    shutdown = stand_in.server.shutdown
    stand_in.server.shutdown = lambda: (taken_down.set(), shutdown())

    class Handler(checked):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if code is not None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                arrivals.append((time.monotonic(), body))
                taken_down.wait(delay_s)
                send_json(self, code, {"message": "status endpoint unavailable"})
                return
            arrivals.append((time.monotonic(), {}))
            taken_down.wait(delay_s)
            with contextlib.suppress(OSError):  # the SDK gave up waiting and closed the connection
                super().do_POST()

    stand_in.server.RequestHandlerClass = Handler
    for name, value in stand_in.env.items():
        monkeypatch.setenv(name, value)
    return stand_in, arrivals


def _train(step: int) -> dict:
    return {"kind": "train", "time": 1.0e9 + step, "step": step, "step_time_s": 0.2, "loss": 3.0 - 0.1 * step,
            "tokens_per_s_per_device": 1000.0, "mfu": 0.3}


def _feed(sink: KubeflowProgressSink, steps: range, clock: list[float] | None = None) -> float:
    """Seconds the sink took over one train record per step (what it adds to the training loop)."""
    spent = 0.0
    for step in steps:
        start = time.monotonic()
        sink("train", _train(step))
        spent += time.monotonic() - start
        if clock is not None:
            clock[0] += 10.0
    return spent


def _wait_for(condition: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "no post reached the stand-in"
        time.sleep(0.05)


def test_a_slow_endpoint_never_holds_a_training_step(tmp_path, monkeypatch, update_trainjob_status):
    # close waits its whole bound here (the poster is still in the SDK's first request): 2 s of it prove the bound
    monkeypatch.setattr(kubeflow_progress, "FINAL_WAIT_S", 2.0)
    stand_in, arrivals = _serve(tmp_path, monkeypatch, delay_s=SERVER_DELAY_S)
    with stand_in:
        sink = KubeflowProgressSink(update_trainjob_status, max_steps=6, world=2, run_dir=tmp_path)
        fed = _feed(sink, range(1, 7))
        fed_at = time.monotonic()
        _wait_for(lambda: arrivals)
        # an ordering: the steps were done before the SDK could have given up on the first post (a sink that
        # waited for it would return SDK_TIMEOUT_S after it arrived at the earliest), however slow the machine
        assert fed_at < arrivals[0][0] + SDK_TIMEOUT_S, f"6 train records took {fed:.1f} s; the first post arrived " \
                                                        f"{fed_at - arrivals[0][0]:.1f} s before they were done"
        assert len(arrivals) == 1  # the first step's report, still in flight: none more within the interval
        start = time.monotonic()
        sink.close("finished")
        closed = time.monotonic() - start
    # close's own bound is its join(FINAL_WAIT_S); what lies above it is the machine's scheduling
    assert closed < kubeflow_progress.FINAL_WAIT_S + LOADED_SLACK_S, f"close took {closed:.1f} s"
    assert len(arrivals) <= 2  # and at most the final post besides


def test_a_failing_endpoint_gets_one_attempt_per_interval_and_one_warning(tmp_path, monkeypatch, caplog,
                                                                           update_trainjob_status):
    stand_in, arrivals = _serve(tmp_path, monkeypatch, code=500)
    clock = [0.0]  # training time: 10 s a step, 12 steps → due at 0, 30, 60 and 90 s
    with stand_in, caplog.at_level(logging.WARNING, logger="shardline"):
        sink = KubeflowProgressSink(update_trainjob_status, max_steps=20, world=2, run_dir=tmp_path,
                                    clock=lambda: clock[0])
        _feed(sink, range(1, 13), clock)
        sink.close("failed")
    due = int(11 * 10.0 // POST_INTERVAL_S) + 1
    assert 1 <= len(arrivals) <= due + 1, f"{len(arrivals)} posts for {due} due and the final one"
    final = arrivals[-1][1]["trainerStatus"]
    assert final["progressPercentage"] == 60  # 12 of 20 steps: a failed run is never reported as 100 %
    assert {m["name"]: m["value"] for m in final["metrics"]}["step"] == "12"
    warnings = [r for r in caplog.records if r.name == "shardline" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_a_healthy_endpoint_gets_the_final_state_at_close(tmp_path, monkeypatch, update_trainjob_status):
    stand_in, arrivals = _serve(tmp_path, monkeypatch)
    with stand_in:
        sink = KubeflowProgressSink(update_trainjob_status, max_steps=6, world=2, run_dir=tmp_path)
        _feed(sink, range(1, 2))
        _wait_for(lambda: stand_in.posts)  # taken by the controller: the final post comes within the SDK's throttle
        _feed(sink, range(2, 7))
        sink("eval", {"kind": "eval", "step": 6, "val_loss": 1.5})
        sink.close("finished")
        closed_at = time.monotonic()
    assert stand_in.refused == []
    assert len(stand_in.posts) == 2  # the first step, then the final state past the SDK's 5 s throttle
    first, last = (p["trainerStatus"] for p in (stand_in.posts[0], stand_in.posts[-1]))
    assert first["progressPercentage"] < 100
    assert last["progressPercentage"] == 100 and last["estimatedRemainingSeconds"] == 0
    metrics = {m["name"]: m["value"] for m in last["metrics"]}
    assert metrics["step"] == metrics["total_steps"] == "6" and metrics["eval_loss"] == "1.5"
    assert metrics["tokens_per_s"] == "2000"
    # an ordering: the final post (the second) had arrived when close returned, however long that took
    assert len(arrivals) == 2 and arrivals[-1][0] < closed_at
