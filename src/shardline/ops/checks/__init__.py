"""Checks a worker runs on the nodes it starts on (`--task netcheck|gpucheck`): the collective bandwidth sweep,
the GPU health and burn-in checks, and the runner that prints and records their verdicts."""
