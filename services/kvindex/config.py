"""kvindex settings, their defaults, and the parsers for durations and sizes on the command line."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from deepinfer.protocol import subjects

DAY_S = 86400.0
# A block expires its class's retention after its last use.
DEFAULT_RETENTION_S = {"agent": 3 * DAY_S, "chat": 7 * DAY_S}

_UNITS_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": DAY_S, "w": 7 * DAY_S}
_UNITS_B = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass
class IndexConfig:
    """Everything the kvindex needs besides its NATS and Redis URLs.

    kv_root: the storage tier's root directory (shared with the workers).
    retention_s: traffic class -> seconds a block lives after its last use;
    default_retention_s for classes not listed.
    capacity_bytes: payload bytes the tier may hold before least-recently-used
    blocks are deleted (0 = no limit).
    sweep_interval_s: seconds between retention / capacity / orphan sweeps.
    ephemeral_ttl_s: age after which an ephemeral block file (a request's
    partial block that decode never picked up), or a temporary file of a block
    write that never finished, is deleted.
    default_block_tokens: tokens per block when neither the event nor the
    file header says.
    redis_prefix: prefix of every Redis key of this index.
    redis_check_s: seconds between Redis health checks (and recovery attempts).
    lookup_timeout_s: a lookup that Redis does not answer in time is a miss.
    durable: JetStream durable consumer name (replicas share it).
    leader_lease_s: seconds the leader's Redis lease lasts; it is renewed every third of
    that, and a replica takes a lease that ran out within a third of it (so a new leader
    takes over at most ~1.3 lease after the old one died; at once after a clean stop).
    """

    kv_root: str
    retention_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RETENTION_S))
    default_retention_s: float = DEFAULT_RETENTION_S["chat"]
    capacity_bytes: int = 0
    sweep_interval_s: float = 60.0
    ephemeral_ttl_s: float = 3600.0
    default_block_tokens: int = 16
    redis_prefix: str = "deepinfer:kv:"
    redis_check_s: float = 1.0
    lookup_timeout_s: float = 0.2
    durable: str = subjects.KV_EVENTS_CONSUMER
    leader_lease_s: float = 3.0

    def retention_of(self, traffic_class: str) -> float:
        """Seconds a block of ``traffic_class`` lives after its last use."""
        return self.retention_s.get(traffic_class, self.default_retention_s)


def parse_duration(text: str) -> float:
    """'90', '90s', '15m', '6h', '3d', '1w' -> seconds. Raises ValueError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw]?)\s*", str(text).lower())
    if not m:
        raise ValueError(f"bad duration {text!r} (e.g. 90s, 15m, 6h, 3d)")
    return float(m.group(1)) * _UNITS_S[m.group(2)]


def parse_size(text: str) -> int:
    """'0', '512M', '10G', '1.5T', '4096' (bytes; binary units) -> bytes. Raises ValueError."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([bkmgt]?)(?:i?b)?\s*", str(text).lower())
    if not m:
        raise ValueError(f"bad size {text!r} (e.g. 512M, 10G)")
    return int(float(m.group(1)) * _UNITS_B[m.group(2)])


def parse_retention(text: str) -> dict[str, float]:
    """'agent=3d,chat=7d' -> {"agent": 259200.0, "chat": 604800.0}. Raises ValueError."""
    out = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"bad retention {part!r} (want CLASS=DURATION)")
        out[name.strip()] = parse_duration(value)
    return out


def env_default(name: str, default: str) -> str:
    return os.environ.get(name, default)
