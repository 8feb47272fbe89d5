"""Benchmark clients and metrics: serving metrics (TECHNIQUES §11) and Mooncake trace replay (issue #6, item 6)."""
