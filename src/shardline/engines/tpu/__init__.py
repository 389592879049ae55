"""TPU slices, where MaxText trains: the spec as MaxText config (maxtext), a multislice JobSet on GKE (jobset), a
KubeRay RayJob (rayjob) and its driver (ray_driver)."""
