"""Balancer service: expert load statistics -> EPLB placement. Not built yet (issue #7)."""
