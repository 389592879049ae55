"""Setting up a cluster for shardline: the in-cluster bootstrap (Kueue, RBAC, namespaces, monitoring) and the GKE
setup and teardown scripts of `shardline cluster plan gke`."""
