"""shardline: train and fine-tune LLMs with PyTorch FSDP2 from one job spec, on any scale."""

__version__ = "0.1.0"
