import numpy as np
import torch

from shardline.data.loader import IGNORE_INDEX, StepSampler, eval_batches, make_batch


def test_ranks_see_disjoint_rows_covering_the_global_batch():
    s = StepSampler(num_rows=100, seed=0, global_rows=16, micro_rows=4, world=2)
    seen = [s.micro_indices(3, k, r) for k in range(s.accum) for r in range(2)]
    flat = np.concatenate(seen)
    assert len(set(flat.tolist())) == 16


def test_global_batch_is_independent_of_world_size():
    one = StepSampler(100, 0, global_rows=8, micro_rows=4, world=1)
    two = StepSampler(100, 0, global_rows=8, micro_rows=4, world=2)
    for step in range(30):
        a = np.concatenate([one.micro_indices(step, k, 0) for k in range(one.accum)])
        b = np.concatenate([two.micro_indices(step, 0, r) for r in range(2)])
        assert sorted(a) == sorted(b)


def test_every_row_once_per_epoch_and_reshuffled_each_epoch():
    s = StepSampler(40, 7, global_rows=8, micro_rows=8, world=1)
    epoch0 = np.concatenate([s.micro_indices(i, 0, 0) for i in range(5)])
    epoch1 = np.concatenate([s.micro_indices(i, 0, 0) for i in range(5, 10)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))
    assert (epoch0 != epoch1).any()


def test_labels_are_next_tokens_on_loss_positions_only(prepared):
    rows = prepared.rows("train")
    b = make_batch(rows, np.array([0, 1]))
    mask = torch.from_numpy(np.asarray(rows.loss_mask[[0, 1]])).bool()
    assert b.n_loss_tokens == int(mask[:, 1:].sum()) == int((b.labels != IGNORE_INDEX).sum())
    where = b.labels != IGNORE_INDEX
    assert torch.equal(b.labels[:, :-1][where[:, :-1]], b.input_ids[:, 1:][where[:, :-1]])


def test_eval_batches_are_equal_in_number_across_ranks(prepared):
    rows = prepared.rows("validation")
    per_rank = [eval_batches(rows, 3, r, 3) for r in range(3)]
    assert len({len(b) for b in per_rank}) == 1
    assert sum(b.n_loss_tokens for bs in per_rank for b in bs) == int(np.asarray(rows.loss_mask)[:, 1:].sum())
