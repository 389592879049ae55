"""Cluster operations: checks a worker runs on its nodes (`checks/`) and cluster setup (`cluster/`)."""
