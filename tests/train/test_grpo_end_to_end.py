"""GRPO through the real trainer and launcher (`train.objective: grpo`) on the generated text-to-SQL questions, with
a user's reward function (`module:function` in the working directory), since a random model's SQL earns the
built-in reward nothing and so moves nothing:

- LoRA in bf16 (the default precision) with a KL to the adapters-off reference, on 2 ranks, 4 groups of G=4
  completions per step, oversampled twice (`train.grpo.oversample`: each rank samples 4 groups and trains the 2
  whose rewards spread most): every step's completions sampled, scored, selected and trained
  (the reward and loss records, the goodput's generation and scoring buckets, the report's GRPO plot), the SQL
  evaluation after it;
- a kill -9 of a rank after step 3 (the last checkpoint step 2's): torchrun restarts the ranks, which sample and train
  step 3 again — the same completions (seeded per step and rank), so the same rewards and losses exactly; `shardline
  eval` of the run runs where the reward function does not import (an evaluation samples nothing);
- a full fine-tune with a KL (`train.grpo.beta`) and two steps per sampling (`train.grpo.num_iterations`): the KL's
  reference is a frozen copy of the starting weights, so the KL is exactly 0 at the first step (the policy is the
  reference) and grows once the policy moves; every second step trains the same completions again against their
  sampling-time log-probabilities, where the clip acts; a SIGTERM in the first step of a sampling waits for the
  second, so the checkpoint resumes exactly.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from shardline.errors import EXIT_PREEMPTED
from tests.conftest import (
    cli_in_background,
    kill_the_stopped_worker,
    read_metrics,
    run_cli,
    small_overrides,
    the_stopped_worker,
)

GRPO = ["train.objective=grpo", "train.grpo.num_generations=4", "train.global_batch_size=16",
        "train.micro_batch_size=4", "train.grpo.max_new_tokens=12", "train.grpo.reward=grpo_rewards:letters",
        "train.lr=3e-3", "train.max_steps=4", "checkpoint.every_steps=2", "observe.metrics_port=null",
        "parallel.nproc_per_node=2", "train.eval_examples=4", "train.eval_max_new_tokens=8"]
REWARD = '''
def letters(prompts, completions, answer, **columns):
    """More distinct letters, more reward: something a random model's samples differ in."""
    assert len(prompts) == len(completions) == len(answer) and all(a.startswith("SELECT") for a in answer)
    return [len(set(c.lower()) & set("abcdefghijklmnopqrstuvwxyz")) / 26 for c in completions]
'''


def _records(run) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run, "train")}


@pytest.mark.slow
def test_bf16_lora_grpo_samples_scores_and_trains_and_a_kill_9_retrains_lost_steps_exactly(tmp_path):
    (tmp_path / "grpo_rewards.py").write_text(REWARD)
    runs = tmp_path / "runs"
    sets = [*small_overrides(runs), *GRPO, "launch.max_restarts=1", "train.grpo.oversample=2",
            "model.lora.enabled=true", "model.lora.r=8", "model.lora.alpha=16", "train.precision=bf16",
            "train.grpo.beta=0.1", "observe.report=true"]
    # rank 1 stops itself before step 4 (its first start only) and is killed with SIGKILL there: step 2 is the last
    # committed checkpoint, so torchrun's restart samples and trains step 3 again, then step 4
    with cli_in_background("train", "tiny", *[a for kv in sets for a in ("--set", kv)], cwd=tmp_path,
                           fault="train_step:rank=1:step=4:restart=0:action=stop") as proc:
        run = kill_the_stopped_worker(runs, proc, after_step=3)
        out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    trained = read_metrics(run, "train")
    assert [r["step"] for r in trained] == [1, 2, 3, 3, 4]
    # the reference is the starting weights, the adapters off: KL 0 at the first step only
    assert trained[0]["grpo"]["kl"] == 0.0 < trained[-1]["grpo"]["kl"]
    first, again = trained[2], trained[3]  # step 3 before the kill and after the restart
    assert again["grpo"]["reward"] == first["grpo"]["reward"]  # the same completions
    assert again["grpo"]["completion_length"] == first["grpo"]["completion_length"]
    assert again["loss"] == pytest.approx(first["loss"], rel=1e-6, abs=1e-9)
    assert again["grpo"]["kl"] == pytest.approx(first["grpo"]["kl"], rel=1e-6, abs=1e-12)
    assert again["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-5)
    resumes = [e for e in read_metrics(run, "event") if e["event"] == "resume"]
    assert [e["step"] for e in resumes] == [2] and resumes[0]["rng_restored"]
    for r in trained:
        g = r["grpo"]
        assert g["completions"] == 16 and 0 < g["completion_length"] <= 12 and g["generation_s"] > 0
        assert 0 < g["reward"] < 1 and g["zero_std"] < 1  # the samples differ: advantages, and a gradient
        assert r["grad_norm"] > 0 and g["kl"] >= 0 and g["clipped"] == 0.0  # one step per sample: r = 1
        assert "solved" not in g  # a user's reward says nothing of solving
        assert g["zero_std"] <= g["sampled_zero_std"] < 1  # the kept groups spread at least as often
    assert "reward" in out
    assert "sql_execution_accuracy" in json.loads((run / "eval.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["goodput"]["generation"] > 0 and summary["goodput"]["scoring"] > 0
    assert summary["goodput"]["wasted"] > 0  # step 3's first run
    assert (run / "report" / "grpo.png").is_file()
    trace = [json.loads(ln) for ln in (run / "logs" / "samples-rank-1.jsonl").read_text().splitlines()]
    assert [len(t["rows"]) for t in trace] == [2] * 5  # each rank samples for 2 of the step's 4 prompts
    for rank in (0, 1):  # the lost step sampled the same completions again
        logged = _rollouts(run, rank)
        assert [r["step"] for r in logged] == [1, 2, 3, 3, 4]
        assert logged[2] == logged[3]
    _check_rollouts(run, tmp_path)

    # `shardline eval` of the finished run needs no reward (run from elsewhere: grpo_rewards does not import there)
    proc = run_cli("eval", str(run))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SQL execution accuracy" in proc.stdout


@pytest.mark.slow
def test_a_full_fine_tune_with_a_kl_and_two_steps_per_sampling_stopped_between_them(tmp_path):
    """A full fine-tune with a KL, two steps per sampling, and a SIGTERM that lands in step 1: a checkpoint after
    step 1 could not resume exactly (the sampled batch and its log-probabilities are not in it), so the run trains
    step 2 too, checkpoints it and stops; the rerun trains steps 3-4."""
    (tmp_path / "grpo_rewards.py").write_text(REWARD)
    runs = tmp_path / "runs"
    sets = [*small_overrides(runs), *GRPO, "parallel.nproc_per_node=1", "train.global_batch_size=8",
            "train.max_steps=4", "train.grpo.beta=0.1", "train.grpo.num_iterations=2", "train.grpo.epsilon=0.01",
            "checkpoint.every_steps=null", "train.eval_examples=0", "observe.report=false",
            "launch.grace_seconds=60"]
    with cli_in_background("train", "tiny", *[a for kv in sets for a in ("--set", kv)], cwd=tmp_path,
                           fault="train_step:rank=0:step=1:action=stop") as proc:
        run, worker = the_stopped_worker(runs, proc)  # the rank stops itself before step 1
        deadline = time.monotonic() + 300
        proc.send_signal(signal.SIGTERM)
        while not _pending(worker, signal.SIGTERM):  # forwarded by the launcher; delivered when the rank goes on
            assert proc.poll() is None and time.monotonic() < deadline, "the SIGTERM never reached the rank"
            time.sleep(0.05)
        os.kill(worker, signal.SIGCONT)
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    assert "GRPO's KL reference: a frozen copy of the starting weights" in out
    preempted = [e for e in read_metrics(run, "event") if e["event"] == "preempted"]
    assert [e["step"] for e in preempted] == [2] and "checkpoint of step 2 committed" in out
    assert [r["step"] for r in read_metrics(run, "train")] == [1, 2]
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000002"]

    proc = run_cli("train", str(run), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(slowest step × 2 (train.grpo.num_iterations) + blocking save" in proc.stdout  # a stop waits a step
    grpo = {r["step"]: r["grpo"] for r in read_metrics(run, "train")}
    # the reference (rebuilt from model.init_seed on resume) is the starting weights: KL 0 only at the first step
    assert grpo[1]["kl"] == 0.0 and grpo[2]["kl"] > 0 and grpo[3]["kl"] > 0 and grpo[4]["kl"] > 0, grpo
    # steps 1 and 3 sample (the resume samples at step 3, as the run would have); steps 2 and 4 train the same
    # completions again against their sampling-time log-probabilities: the ratio has moved, so the clip acts
    assert [r["step"] for r in _rollouts(run, 0)] == [1, 3]
    for sampled, again in ((1, 2), (3, 4)):
        assert grpo[sampled]["generation_s"] > 0 and grpo[again]["generation_s"] == 0.0
        assert grpo[again]["reward"] == grpo[sampled]["reward"]
        assert grpo[again]["completion_length"] == grpo[sampled]["completion_length"]
        assert grpo[sampled]["clipped"] == 0.0 < grpo[again]["clipped"]


def _pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits for delivery to the process (its thread's or the process's pending set)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return any(int(fields[key], 16) >> (signum - 1) & 1 for key in ("SigPnd", "ShdPnd"))


def _rollouts(run, rank: int) -> list[dict]:
    return [json.loads(ln) for ln in (run / "logs" / f"rollouts-rank-{rank}.jsonl").read_text().splitlines()]


def _check_rollouts(run, module_dir) -> None:
    """Each rank's logged completions, rewards and advantages: the rewards are the user's function of the logged
    completions, and the advantages are each group's normalised rewards over both ranks' completions (rank 0's
    groups first) — the rewards and advantages line up with the completions the ranks trained on; the groups kept
    are the 2 of each rank's 4 sampled whose rewards spread most."""
    import importlib.util

    import torch

    from shardline.training.grpo import group_advantages, most_informative

    loaded = importlib.util.spec_from_file_location("grpo_rewards_check", module_dir / "grpo_rewards.py")
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    ranks = [_rollouts(run, rank) for rank in (0, 1)]
    for steps in zip(*ranks, strict=True):
        rewards = []
        for logged in steps:
            assert len(logged["completions"]) == 8 and len(logged["prompts"]) == 2
            expected = module.letters(prompts=logged["completions"], completions=logged["completions"],
                                      answer=["SELECT"] * 8)
            assert logged["rewards"] == pytest.approx(expected)
            kept = most_informative(logged["sampled_rewards"], 4, 2)
            assert logged["rewards"] == [logged["sampled_rewards"][r] for r in kept]
            assert logged["prompts"] == [logged["sampled_prompts"][r // 4] for r in kept[::4]]
            assert len(logged["sampled_prompts"]) == 4 and len(set(logged["sampled_prompts"])) == 4
            rewards += logged["rewards"]
        advantages, _ = group_advantages(torch.tensor(rewards), 4, "group")
        assert steps[0]["advantages"] + steps[1]["advantages"] == pytest.approx(advantages.tolist(), abs=1e-5)
