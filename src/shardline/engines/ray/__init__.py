"""Ray: a Ray job on a running cluster or a KubeRay RayJob (backend), and the worker under Ray Train (train)."""
