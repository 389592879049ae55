"""Group relative policy optimisation (`train.objective: grpo`): every `train.grpo.num_iterations` steps the
policy samples G completions of each of the step's prompts and a reward scores them; the steps between train on
those completions with the clipped surrogate (and a KL to the reference). A micro-batch's share: its terms reduced
by `train.grpo.loss` over the global batch's normalisers. The loss maths: `training.grpo`; the sampling:
`training.rollout`."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from shardline.data.loader import Batch, StepSampler
from shardline.errors import ShardlineError
from shardline.spec.objective import frozen_reference_copy
from shardline.tasks import Rewards
from shardline.training.grpo import (
    METRICS,
    Normalisers,
    group_advantages,
    mean_metrics,
    most_informative,
    reduce_loss,
    token_terms,
    without_spread,
)
from shardline.training.loss import rank_part, token_losses
from shardline.training.objectives.base import Run, Share, StepBatches
from shardline.training.objectives.reference import ReferencePolicy
from shardline.training.objectives.sft import Sft
from shardline.training.preference import document_targets
from shardline.training.rewards import reward_function
from shardline.training.rollout import (
    Completions,
    SampledBatch,
    decoded,
    prompt_pool,
    rollout_batches,
    sample_completions,
    sampling_seed,
)


class Grpo(Sft):
    """GRPO's rollouts and clipped loss; validation is the next-token loss of the validation rows (as SFT's)."""

    sampling_field = "train.grpo.num_iterations"
    supports_context_parallel = False  # a completion's log-probabilities are summed on the rank holding its row

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        g = run.spec.train.grpo
        self.steps_per_sampling = g.num_iterations
        self.reference = None
        if g.beta:  # the KL's reference: the adapters off, or in a full fine-tune a frozen copy
            self.reference = ReferencePolicy(run, "frozen_copy" if frozen_reference_copy(run.spec) else "adapters_off")
        self.sampled: SampledBatch | None = None  # the completions the next steps train on
        self.fresh = {"generation_s": 0.0, "reward_s": 0.0}

    def prepare(self) -> None:
        """GRPO's prompts (the training examples that ask something and fit), its reward (a user's function is
        imported here: a bad name fails before the first step) and the sampler that draws each step's prompts.
        Not at construction: an evaluation of a GRPO run needs none of them."""
        run, t = self.run, self.run.spec.train
        self.prompts = prompt_pool(run.data.examples("train"), run.tokenizer, run.task.prompt,
                                   run.spec.data.prompt_format, t.seq_len - t.grpo.max_new_tokens)
        if not self.prompts.examples:
            raise ShardlineError("data", f"no training example asks something that fits train.seq_len={t.seq_len} "
                                 f"with train.grpo.max_new_tokens={t.grpo.max_new_tokens} ({self.prompts.too_long} "
                                 "prompts too long)", "use rows with prompts, raise train.seq_len or lower "
                                 "train.grpo.max_new_tokens")
        self.reward = reward_function(t.grpo.reward, run.task, run.spec.data)
        prompts = t.global_batch_size // t.grpo.num_generations * t.grpo.oversample  # candidates, when oversampled
        self.sampler = StepSampler(len(self.prompts.examples), t.seed, prompts, prompts // run.dp_world, run.dp_world)
        if self.prompts.too_long:
            run.say(f"GRPO: {len(self.prompts.examples):,} training prompts; {self.prompts.too_long:,} longer than "
                    f"train.seq_len − train.grpo.max_new_tokens = {t.seq_len - t.grpo.max_new_tokens} skipped")

    def describe(self) -> list[str]:
        if self.reference is None or not (held := self.reference.held_bytes()):
            return []
        return [f"GRPO's KL reference: a frozen copy of the starting weights, sharded like the policy "
                f"({held / 2**30:.2f} GiB on this rank)"]

    def sample(self, step: int) -> float:
        """The completions step `step` + 1 trains on: sampled now at a sampling step (or on a resume that lands
        between two, which checkpoints never do), else the ones the last sampling step drew."""
        if self.sampled is None or step % self.steps_per_sampling == 0:
            sampler_step = -(-step // self.steps_per_sampling)
            self.sampled = self._rollout(step, self.sampler.micro_indices(sampler_step, 0, self.run.dp_rank))
        fresh = self.sampled.step == step + 1
        self.fresh = {"generation_s": self.sampled.generation_s if fresh else 0.0,
                      "reward_s": self.sampled.reward_s if fresh else 0.0}
        return self.fresh["generation_s"] + self.fresh["reward_s"]

    def step_batches(self, step: int) -> StepBatches:
        return StepBatches([r.batch.to(self.run.ctx.device) for r in self.sampled.batches], [self.sampled.index])

    def _rollout(self, step: int, index) -> SampledBatch:
        """This rank's share of the step's prompts, G completions each sampled and scored (`oversample` × the share,
        of which the groups whose rewards spread most are kept); every completion's advantage (rewards gathered
        from every rank: a group's, or the batch's, statistics)."""
        run, t, g, ctx = self.run, self.run.spec.train, self.run.spec.train.grpo, self.run.ctx
        started = time.perf_counter()
        index = [int(i) for i in index]
        share = len(index) // g.oversample
        completions = Completions([], [])
        with record_function("shardline.generate"):
            for k in range(g.oversample):  # one prompt share per call: the sampling memory the plan counts
                part = index[k * share:(k + 1) * share]
                found = sample_completions(
                    run.model, [self.prompts.ids[i] for i in part], [self.prompts.stops[i] for i in part],
                    g.num_generations, g.temperature, g.top_p, g.max_new_tokens, run.data.meta["pad_id"],
                    ctx.device, ctx.world > 1, sampling_seed(t.seed, step, run.dp_rank, k))
                completions = Completions(completions.ids + found.ids, completions.ended + found.ended)
        generated = time.perf_counter()
        with record_function("shardline.reward"):
            repeated = [i for i in index for _ in range(g.num_generations)]
            texts = decoded(run.tokenizer, completions.ids)
            rewards = self.reward([self.prompts.examples[i] for i in repeated],
                                  decoded(run.tokenizer, [self.prompts.ids[i] for i in repeated]), texts)
        scored = time.perf_counter()
        sampled = {"sampled": len(texts), "sampled_zero_std": without_spread(rewards.values, g.num_generations)}
        candidates = {}  # the rollout log's record of what the selection chose from
        if g.oversample > 1:  # dynamic sampling: the groups that teach most
            candidates = {"sampled_prompts": index, "sampled_rewards": rewards.values}
            kept = most_informative(rewards.values, g.num_generations, share)
            index = [index[r // g.num_generations] for r in kept[::g.num_generations]]
            repeated, texts, completions = [repeated[r] for r in kept], [texts[r] for r in kept], completions.rows(kept)
            rewards = Rewards([rewards.values[r] for r in kept], rewards.solved and [rewards.solved[r] for r in kept])
        local = torch.tensor(rewards.values, dtype=torch.float32, device=ctx.device)
        everyone = [torch.empty_like(local) for _ in range(ctx.world)]
        dist.all_gather(everyone, local)
        advantages, group_std = group_advantages(torch.cat(everyone), g.num_generations, g.scale_rewards)
        mine = slice(run.dp_rank * local.numel(), (run.dp_rank + 1) * local.numel())
        with (run.run_dir / "logs" / f"rollouts-rank-{ctx.rank}.jsonl").open("a") as f:  # what was sampled, scored
            f.write(json.dumps({"step": step + 1, "prompts": index, "completions": texts,
                                "ended": completions.ended, "rewards": rewards.values,
                                "advantages": [round(a, 6) for a in advantages[mine].tolist()], **candidates}) + "\n")
        solved = rewards.solved or []
        found = {"completions": len(rewards.values), "reward": sum(rewards.values),
                 "reward_std": float(group_std[mine].sum()),
                 "zero_std": without_spread(rewards.values, g.num_generations),
                 "solved": sum(solved), "scored": len(solved), "completion_tokens": sum(map(len, completions.ids)),
                 "truncated": sum(not e for e in completions.ended), **sampled}  # kl, clipped: in the backward
        sums = torch.tensor([float(found.get(name, 0.0)) for name in METRICS], dtype=torch.float64, device=ctx.device)
        batches = rollout_batches([self.prompts.ids[i] for i in repeated], completions.ids, t.micro_batch_size,
                                  t.seq_len, run.data.meta["pad_id"])
        return SampledBatch(step + 1, index, batches, advantages[mine], sums, generated - started,
                            scored - generated, [None] * len(batches))

    def begin_step(self, loss_tokens: torch.Tensor) -> None:
        """The global batch's normalisers: its completion tokens (all-reduced), completions and micro-batches."""
        t = self.run.spec.train
        self.sums = self.sampled.sums.clone()
        tokens = self.sums[METRICS.index("completion_tokens")].clone()
        dist.all_reduce(tokens)
        self.norm = Normalisers(tokens=float(tokens.clamp(min=1)), completions=float(t.global_batch_size),
                                micro_batches=float(len(self.sampled.batches) * self.run.dp_world))

    @contextlib.contextmanager
    def micro_batch(self, k: int, batch: Batch) -> Iterator[Share]:
        t, g, device = self.run.spec.train, self.run.spec.train.grpo, self.run.ctx.device
        model, sampled, part = self.run.model, self.sampled, self.sampled.batches[k]
        documents, n_documents = document_targets(batch)
        documents = documents.to(device)
        per_token = sampled.advantages[torch.from_numpy(part.completions).to(device)][documents]
        ref = None
        if self.reference is not None:
            with self.reference.forward() as reference:
                ref = -token_losses(reference, batch, t.loss_chunk_tokens, g.temperature)
        with rank_part(model, batch, None):
            with record_function("shardline.forward"):
                logp = -token_losses(model, batch, t.loss_chunk_tokens, g.temperature)
                if sampled.old_logps[k] is None and g.num_iterations > 1:  # π_old, for the later steps
                    sampled.old_logps[k] = logp.detach()
                old = logp.detach() if sampled.old_logps[k] is None else sampled.old_logps[k]
                terms = token_terms(logp, old, ref, per_token, g)
                loss = reduce_loss(terms, documents, n_documents, self.norm, g)
            yield Share(loss, loss.detach().double())
        if terms.kl is not None:
            self.sums[METRICS.index("kl")] += terms.kl.detach().double().sum()
        self.sums[METRICS.index("clipped")] += terms.clipped.double().sum()

    def end_step(self) -> dict[str, Any]:
        """The global batch's means (`training.grpo.mean_metrics`) and this step's sampling and scoring seconds."""
        dist.all_reduce(self.sums)
        grpo = dict(self.fresh)
        grpo.update(mean_metrics(self.sums))  # the loss: the step's own, summed over ranks with its timings
        for name in ("generation_s", "reward_s"):
            grpo[name] = round(grpo[name], 4)
        return {"grpo": grpo}

    def trend(self, first: Any, last: Any) -> str:
        """Its loss is a policy gradient's surrogate: the reward is what moves."""
        return (f"reward {first.grpo['reward']:.3f} → {last.grpo['reward']:.3f} "
                "(mean of each step's completions)")


OBJECTIVE = Grpo
