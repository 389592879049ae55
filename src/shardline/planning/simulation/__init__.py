"""The planner's step simulator (`plan --dry-run`): the real sharding at any world size as one rank of a fake
process group, and one training step on fake tensors measured for its peak memory and FLOPs. It runs the loop's
own step parts (`training.loss`, `training.optim`), so it sits in the training layer though it lives beside
the planner."""
