"""Vertex AI: the CustomJob of a spec (job), its submission and status (backend), what each replica runs (entry)."""
