"""Balancer service: expert load statistics -> EPLB placements for MoE workers.

``eplb`` is the algorithm (deepseek-ai/EPLB), ``tracker`` the moving average and the
rebalance triggers, ``service`` the NATS service.
"""
