"""Observability: the Prometheus endpoint, experiment trackers, dashboards and alert rules, the run report."""
