"""The package version (one place; the manifest and `shardline --version` read it)."""

__version__ = "0.1.0"
