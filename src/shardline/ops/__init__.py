"""Cluster operations: network and GPU checks, cluster bootstrap and provisioning plans."""
