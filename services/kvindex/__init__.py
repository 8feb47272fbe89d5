"""kvindex service: prefix index over Redis, KV events, retention, hit statistics. Not built yet (issue #4)."""
