"""Latency and acceptance reports (`specexport bench`)."""
