"""kvindex service: which KV blocks the shared storage tier holds (Redis), KV events, retention, hit statistics.

``service.py`` (the NATS side and its lifecycle), ``index.py`` (the Redis data
model), ``maintenance.py`` (re-sync, retention, capacity), ``config.py``.
Workers talk to it through ``deepinfer.kvstore.index_client.KVIndexClient``.
"""
