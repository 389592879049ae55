"""Warnings other packages print on import that say nothing about a shardline run, dropped at their loggers.

transformers imports torchao whenever it is installed (shardline's QLoRA base needs it), and torchao then warns
on every process that its optional CUDA kernels (mxfp8, CUTLASS) do not load into a CPU build of torch and that it
registers enums torch's pytree no longer needs registered. shardline uses torchao's NF4 tensor only, which is
plain PyTorch; the warnings would otherwise open every command's output. Other messages of those loggers pass.
"""

from __future__ import annotations

import logging

NOISE = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
}
"""Logger name → message fragments dropped there."""


class DropNoise(logging.Filter):
    """Drops a logger's records whose message contains one of `fragments`."""

    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def install() -> None:
    """Attach the filters (idempotent: one per logger)."""
    for name, fragments in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropNoise) for f in logger.filters):
            logger.addFilter(DropNoise(fragments))
