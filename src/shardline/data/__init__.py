"""Data: sources → prepared, memory-mapped token shards → batches."""

PREPARED_DATA_ENV = "SHARDLINE_PREPARED_DATA"
"""Set by the local launcher for its workers: the prepared directory it built for their spec, so a worker opens it
instead of regenerating or re-hashing the sources to find the version (`prepare.prepared_by_launcher`)."""
