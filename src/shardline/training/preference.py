"""Direct preference optimisation on packed pairs (`train.objective: dpo`).

A pair is two documents packed side by side in one row, chosen then rejected (`shardline.data.encode`), each with
its own positions and per-document attention. A completion's log-probability is the sum of its targets'
log-probabilities: one forward gives every document's, and the row's real documents pair up in order. The
reference is the same model with its LoRA adapters off (a no-grad forward), or a table of log-probabilities
computed once with the starting weights (`ReferenceTable`), kept in every checkpoint so a resume reuses it.

The losses are TRL's `DPOTrainer` losses of the same names (its `loss_type`): with Δ = (log π_c − log π_ref,c) −
(log π_r − log π_ref,r), `sigmoid` is −log σ(βΔ); `sigmoid_norm` and `ipo` take each log-ratio per completion
token, then −log σ(βΔ) and (Δ − 1/(2β))². A step's loss is the mean over the global batch's pairs, plus
`train.dpo.sft_weight` × the chosen completions' NLL per token over the global batch (TRL's `loss_type=[..., "sft"]`
with that weight; RPO's remedy for DPO lowering the chosen completions' likelihood).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardline.data.loader import IGNORE_INDEX, Batch, eval_batches
from shardline.data.packing import PackedRows
from shardline.model.expert_lora import expert_adapters_off
from shardline.model.router_lora import router_adapters_off
from shardline.spec import DpoSpec
from shardline.training.loss import token_losses

METRICS = ("pairs", "loss", "chosen_reward", "rejected_reward", "accuracy", "chosen_logp", "rejected_logp",
           "prefers_chosen", "chosen_tokens")
"""The summed per-pair quantities a step or a validation reduces over ranks (`pair_metrics`), `pairs` first:
`accuracy` counts pairs whose chosen reward exceeds the rejected one (relative to the reference, TRL's
`rewards/accuracies`), `prefers_chosen` those whose chosen completion is the more likely (the model alone)."""


@dataclass
class PairLogps:
    """Summed target log-probabilities of a batch's pairs ([pairs] each) and their target counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def document_targets(batch: Batch) -> tuple[torch.Tensor, int]:
    """For each loss-bearing position of `batch` in flattened order, the index of its real document (the batch's
    real documents numbered in order); and the number of real documents. On the host, from the spans."""
    spans = batch.spans
    if spans is None:
        raise ValueError("a preference batch needs its document spans (context parallel splits them)")
    lengths = torch.tensor(spans.lengths)
    real = torch.tensor(spans.real)
    number = torch.cumsum(real.long(), 0) - 1  # a real span's index among real spans
    per_position = torch.repeat_interleave(number, lengths)
    targets = batch.labels.flatten().cpu() != IGNORE_INDEX
    return per_position[targets], int(real.sum())


def pair_logps(model: nn.Module, batch: Batch, chunk_tokens: int | None) -> PairLogps:
    """Every pair's chosen and rejected completion log-probabilities under `model` (with gradients if enabled)."""
    docs, n_docs = document_targets(batch)
    if batch.n_loss_tokens == 0:  # an evaluation's filler batch: its forward runs (lockstep), it holds no pair
        n_docs = 0
    if n_docs % 2:
        raise ValueError(f"a preference batch holds {n_docs} documents: pairs are packed whole, chosen then rejected")
    logp = -token_losses(model, batch, chunk_tokens)
    device = logp.device
    docs = docs.to(device)
    sums = torch.zeros(max(n_docs, 1), dtype=logp.dtype, device=device).index_add(0, docs, logp)
    counts = torch.bincount(docs, minlength=max(n_docs, 1)).to(logp.dtype)
    if n_docs == 0:
        empty = sums[:0] + 0 * logp.sum()  # keeps the graph: every rank backpropagates through its forward
        return PairLogps(empty, empty, empty.detach(), empty.detach())
    return PairLogps(sums[0::2][: n_docs // 2], sums[1::2], counts[0::2], counts[1::2])


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The LoRA model as its base: peft's adapters, the routed experts' (`shardline.model.expert_lora`) and the
    routers' (`shardline.model.router_lora`), disabled for the block, the trainable parameters unchanged."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    peft_off = model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()
    with peft_off, expert_adapters_off(model), router_adapters_off(model):  # type: ignore[operator]
        # peft also clears requires_grad on the adapter weights, and sets it on exit on whichever copies the modules
        # hold then. Under FSDP2 both would harm: it fixes a block's gradient dtypes at the model's first forward
        # from the parameters that require grad (were that this one, as in DPO's step-0 validation, the bf16
        # gradients would reach the fp32 adapters uncast: issue 52), and a block left gathered after a no-grad
        # forward (`parallel.reshard_after_forward: false`) would leave its sharded adapters frozen.
        for p in trainable:
            p.requires_grad_(True)
        yield


def dpo_losses(policy: PairLogps, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               spec: DpoSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses, and the implicit rewards β·(log π − log π_ref) of chosen and rejected (detached)."""
    chosen_ratio = policy.chosen - ref_chosen
    rejected_ratio = policy.rejected - ref_rejected
    if spec.loss == "sigmoid":
        delta = chosen_ratio - rejected_ratio
    else:  # per completion token
        delta = chosen_ratio / policy.chosen_tokens.clamp(min=1) - rejected_ratio / policy.rejected_tokens.clamp(min=1)
    losses = (delta - 1 / (2 * spec.beta)) ** 2 if spec.loss == "ipo" else -F.logsigmoid(spec.beta * delta)
    return losses, spec.beta * chosen_ratio.detach(), spec.beta * rejected_ratio.detach()


def pair_metrics(losses: torch.Tensor, chosen_reward: torch.Tensor, rejected_reward: torch.Tensor,
                 policy: PairLogps) -> torch.Tensor:
    """This batch's sums of `METRICS`, float64, to be added up over batches and ranks."""
    return torch.stack([
        torch.tensor(float(losses.numel()), dtype=torch.float64, device=losses.device),
        losses.detach().double().sum(), chosen_reward.double().sum(), rejected_reward.double().sum(),
        (chosen_reward > rejected_reward).double().sum(), policy.chosen.detach().double().sum(),
        policy.rejected.detach().double().sum(), (policy.chosen > policy.rejected).double().sum(),
        policy.chosen_tokens.double().sum(),
    ])


def mean_metrics(sums: torch.Tensor, sft_weight: float = 0.0) -> dict[str, float]:
    """`METRICS` means over the pairs summed in `sums` (all ranks' after an all-reduce), the reward margin, the
    chosen completions' per-token NLL (`chosen_nll`) and the loss with `train.dpo.sft_weight` of it added."""
    values = dict(zip(METRICS, sums.tolist(), strict=True))
    pairs = max(values["pairs"], 1.0)
    out = {name: values[name] / pairs for name in METRICS[1:-1]}
    out["margin"] = out["chosen_reward"] - out["rejected_reward"]
    out["chosen_nll"] = -values["chosen_logp"] / max(values["chosen_tokens"], 1.0)
    out["loss"] += sft_weight * out["chosen_nll"]
    return {"pairs": int(values["pairs"]), **out}


def chosen_targets(batches: list[Batch]) -> int:
    """Loss-bearing tokens of the chosen completions in `batches` (the even real documents)."""
    total = 0
    for b in batches:
        if b.n_loss_tokens:
            docs, _ = document_targets(b)
            total += int((docs % 2 == 0).sum())
    return total


def pairs_in(batches: list[Batch]) -> int:
    """Pairs in `batches` (their real documents, two per pair)."""
    return sum(sum(b.spans.real) // 2 for b in batches if b.n_loss_tokens)


def documents_per_row(rows: PackedRows) -> np.ndarray:
    """Real documents in each packed row: positions restarting at 0 before the row's padding."""
    positions = np.asarray(rows.position_ids)
    real = np.arange(positions.shape[1])[None, :] < np.asarray(rows.n_real)[:, None]
    return ((positions == 0) & real).sum(axis=1)


def eval_row_indices(n: int, batch_rows: int, rank: int, world: int) -> list[np.ndarray]:
    """The rows of each of `eval_batches(rows, batch_rows, rank, world)`'s batches (empty for a filler batch)."""
    per_rank = -(-n // world)
    mine = np.arange(rank * per_rank, min(n, (rank + 1) * per_rank))
    return [mine[b * batch_rows : (b + 1) * batch_rows] for b in range(-(-per_rank // batch_rows))]


class ReferenceTable:
    """The reference log-probability of every document of a split's rows (`train.dpo.reference: precomputed`),
    computed once with the starting weights; a tensor in every checkpoint, so a resumed run finds the same."""

    def __init__(self, rows: PackedRows, device: torch.device) -> None:
        counts = documents_per_row(rows)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.values = torch.zeros(int(self.offsets[-1]), dtype=torch.float64, device=device)

    def lookup(self, index: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen and rejected reference log-probabilities of the pairs in the rows `index`, in the order a
        batch of them holds its documents (rows sorted, as `make_batch` gathers them)."""
        picks = np.concatenate([np.arange(self.offsets[r], self.offsets[r + 1]) for r in np.sort(index)])
        values = self.values[torch.from_numpy(picks).to(self.values.device)]
        return values[0::2], values[1::2]

    @torch.no_grad()
    def compute(self, model: nn.Module, rows: PackedRows, micro_rows: int, rank: int, world: int,
                chunk_tokens: int | None, device: torch.device) -> None:
        """Fill the table with `model`'s log-probabilities: each rank its share of the rows, summed over ranks."""
        model.eval()
        try:
            indices = eval_row_indices(len(rows.n_real), micro_rows, rank, world)
            for index, batch in zip(indices, eval_batches(rows, micro_rows, rank, world), strict=True):
                logps = pair_logps(model, batch.to(device), chunk_tokens)
                if len(index) == 0:
                    continue
                start = int(self.offsets[index[0]])
                mine = torch.stack([logps.chosen, logps.rejected], dim=1).flatten().double()
                self.values[start : start + mine.numel()] = mine
        finally:
            model.train()
        dist.all_reduce(self.values)
