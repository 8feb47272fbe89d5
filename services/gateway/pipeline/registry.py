"""Live registry of workers, fed by their ``LoadReport`` heartbeats.

Every worker publishes a ``LoadReport`` on ``deepinfer.load.<role>.<worker_id>``
every ``interval_s``; the registry keeps the last report and when it was seen.

Parameters (defaults):
  missed_intervals = 3    a worker silent for this many of its own intervals is dead
  min_dead_after_s = 3.0  ... but never sooner than this (one lost packet is not death)
  forget_after_s   = 300  entries silent this long are dropped (bounded memory)

``is_alive(worker_id, since)`` is what a request waiting on a worker asks:
``since`` (when the request started watching it) stands in for a heartbeat
from a worker not heard from yet, so a brand-new worker gets one full grace
period. ``counts()`` (for /health) counts live, non-draining workers by role.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from deepinfer.mesh import MeshClient
from deepinfer.protocol import LoadReport, ProtocolError, subjects, unpack
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


@dataclass
class WorkerInfo:
    report: LoadReport
    last_seen: float


class WorkerRegistry:
    def __init__(
        self,
        missed_intervals: float = 3,
        min_dead_after_s: float = 3.0,
        forget_after_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.missed_intervals = missed_intervals
        self.min_dead_after_s = min_dead_after_s
        self.forget_after_s = forget_after_s
        self.clock = clock
        self.started_at = clock()
        self._workers: dict[str, WorkerInfo] = {}
        self._sub = None

    async def start(self, mesh: MeshClient) -> None:
        self.started_at = self.clock()
        self._sub = await mesh.nc.subscribe(subjects.LOAD_ALL, cb=self._on_msg)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection already closed
                pass
            self._sub = None

    async def _on_msg(self, raw) -> None:
        try:
            self.observe(unpack(raw.data, expect=LoadReport))
        except ProtocolError as e:
            log.warning("bad_load_report", subject=raw.subject, error=str(e))

    def observe(self, report: LoadReport) -> None:
        self._workers[report.worker_id] = WorkerInfo(report, self.clock())

    def dead_after(self, worker_id: str) -> float:
        info = self._workers.get(worker_id)
        interval = info.report.interval_s if info else 1.0
        return max(self.missed_intervals * interval, self.min_dead_after_s)

    def is_alive(self, worker_id: str, since: float | None = None) -> bool:
        info = self._workers.get(worker_id)
        last = max(info.last_seen if info else float("-inf"), since if since is not None else float("-inf"))
        return self.clock() - last <= self.dead_after(worker_id)

    @property
    def warm(self) -> bool:
        """Listened long enough that a live worker must have been heard from."""
        return self.clock() - self.started_at >= self.min_dead_after_s

    def alive(self, role: str | None = None) -> list[WorkerInfo]:
        self._forget_silent()
        return [
            w
            for w in self._workers.values()
            if (role is None or w.report.role == role) and self.is_alive(w.report.worker_id)
        ]

    def counts(self) -> dict[str, int]:
        """Live workers that take new requests (not draining), by role."""
        out: dict[str, int] = {}
        for w in self.alive():
            if not w.report.draining:
                out[w.report.role] = out.get(w.report.role, 0) + 1
        return out

    def _forget_silent(self) -> None:
        now = self.clock()
        for wid in [w for w, info in self._workers.items() if now - info.last_seen > self.forget_after_s]:
            del self._workers[wid]
