"""GRPO through the real trainer and launcher (`train.objective: grpo`) on the generated text-to-SQL questions, with
a user's reward function (`module:function` in the working directory), since a random model's SQL earns the
built-in reward nothing and so moves nothing:

- 2 ranks, 4 groups of G=4 completions per step: every step's completions sampled, scored and trained (the reward
  and loss records, the goodput's generation and scoring buckets, the report's GRPO plot), the SQL evaluation after
  it;
- a run whose last checkpoint never committed (a kill during the final save) trains the lost steps again: the same
  completions are sampled (seeded per step and rank), so the same rewards and losses come back exactly; `shardline
  eval` of it runs where the reward function does not import (an evaluation samples nothing);
- a full fine-tune with a KL (`train.grpo.beta`): its reference is a frozen copy of the starting weights, so the
  KL is exactly 0 at the first step (the policy is the reference) and grows once the policy moves.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import only_run, read_metrics, run_cli, small_overrides

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
def test_grpo_samples_scores_and_trains_and_retrains_lost_steps_exactly(tmp_path):
    (tmp_path / "grpo_rewards.py").write_text(REWARD)
    runs = tmp_path / "runs"
    sets = [*small_overrides(runs), *GRPO]
    proc = run_cli("train", "tiny", *[a for kv in sets for a in ("--set", kv)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = only_run(runs)
    full = _records(run)
    assert sorted(full) == [1, 2, 3, 4]
    for r in full.values():
        g = r["grpo"]
        assert g["completions"] == 16 and 0 < g["completion_length"] <= 12 and g["generation_s"] > 0
        assert 0 < g["reward"] < 1 and g["zero_std"] < 1  # the samples differ: advantages, and a gradient
        assert r["grad_norm"] > 0 and g["kl"] == 0.0 and g["clipped"] == 0.0  # beta 0; one step per sample
        assert "solved" not in g  # a user's reward says nothing of solving
    assert "reward" in proc.stdout and "GRPO" not in proc.stderr
    assert "sql_execution_accuracy" in json.loads((run / "eval.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["goodput"]["generation"] > 0 and summary["goodput"]["scoring"] > 0
    assert (run / "report" / "grpo.png").is_file()
    trace = [json.loads(ln) for ln in (run / "logs" / "samples-rank-1.jsonl").read_text().splitlines()]
    assert [len(t["rows"]) for t in trace] == [2] * 4  # each rank samples for 2 of the step's 4 prompts
    _check_rollouts(run, tmp_path)

    # a kill during the final save: step 4 never committed, steps 3-4 are sampled and trained again from step 2
    (run / "checkpoints" / "step-00000004" / "COMMITTED").unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(ln for ln in lines if not any(
        f'"step": {s},' in ln or f'"step": {s}}}' in ln for s in (3, 4))) + "\n")
    proc = run_cli("train", str(run), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = _records(run)
    assert sorted(again) == [1, 2, 3, 4]
    for step in (3, 4):
        assert again[step]["grpo"]["reward"] == full[step]["grpo"]["reward"]  # the same completions
        assert again[step]["grpo"]["completion_length"] == full[step]["grpo"]["completion_length"]
        assert again[step]["loss"] == pytest.approx(full[step]["loss"], rel=1e-6, abs=1e-9)
        assert again[step]["grad_norm"] == pytest.approx(full[step]["grad_norm"], rel=1e-5)

    for rank in (0, 1):  # the lost steps sampled the same completions again
        logged = _rollouts(run, rank)
        assert [r["step"] for r in logged] == [1, 2, 3, 4, 3, 4]
        assert logged[2]["completions"] == logged[4]["completions"] and logged[3] == logged[5]

    # `shardline eval` of the finished run needs no reward (run from elsewhere: grpo_rewards does not import there)
    proc = run_cli("eval", str(run))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SQL execution accuracy" in proc.stdout


@pytest.mark.slow
def test_a_full_fine_tune_with_a_kl_keeps_a_frozen_copy_of_the_starting_weights(tmp_path):
    (tmp_path / "grpo_rewards.py").write_text(REWARD)
    runs = tmp_path / "runs"
    sets = [*small_overrides(runs), *GRPO, "parallel.nproc_per_node=1", "train.global_batch_size=8",
            "train.max_steps=3", "train.grpo.beta=0.1", "checkpoint.every_steps=null", "train.eval_examples=0",
            "observe.report=false"]
    proc = run_cli("train", "tiny", *[a for kv in sets for a in ("--set", kv)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GRPO's KL reference: a frozen copy of the starting weights" in proc.stdout
    kl = {r["step"]: r["grpo"]["kl"] for r in read_metrics(only_run(runs), "train")}
    assert kl[1] == 0.0 and kl[2] > 0 and kl[3] > 0, kl


def _rollouts(run, rank: int) -> list[dict]:
    return [json.loads(ln) for ln in (run / "logs" / f"rollouts-rank-{rank}.jsonl").read_text().splitlines()]


def _check_rollouts(run, module_dir) -> None:
    """Each rank's logged completions, rewards and advantages: the rewards are the user's function of the logged
    completions, and the advantages are each group's normalised rewards over both ranks' completions (rank 0's
    groups first) — the rewards and advantages line up with the completions the ranks trained on."""
    import importlib.util

    import torch

    from shardline.training.grpo import group_advantages

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
            rewards += logged["rewards"]
        advantages, _ = group_advantages(torch.tensor(rewards), 4, "group")
        assert steps[0]["advantages"] + steps[1]["advantages"] == pytest.approx(advantages.tolist(), abs=1e-5)
