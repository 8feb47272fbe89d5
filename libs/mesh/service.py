"""Service lifecycle: start -> heartbeat -> drain -> stop.

A service subclass sets ``role``, subscribes its handlers in ``setup()`` and
describes its load in ``load_report()``. ``run_service`` runs it until SIGINT
or SIGTERM, then drains and stops. Draining, in order: ``draining`` is set (a
handler refuses new work with "draining", which senders take as "try another
worker") and announced at once in a heartbeat (routers skip the worker); the
``intake`` subscriptions (the queue groups that bring new work) are drained,
so the NATS server sends new work to other replicas and what was already
delivered is answered; ``finish_inflight()`` lets in-flight work end
(bounded); heartbeats stop; the connection is drained (pending handlers
finish, flushed) and closed.
"""

from __future__ import annotations

import asyncio
import signal
import uuid

from deepinfer.mesh.client import MeshClient
from deepinfer.protocol import LoadReport, subjects
from deepinfer.telemetry import configure_logging, configure_tracing, get_logger, metrics, shutdown_tracing

log = get_logger(__name__)


class Service:
    role: str = "service"

    def __init__(self, nats_url: str, worker_id: str | None = None, heartbeat_s: float = 1.0):
        self.nats_url = nats_url
        self.worker_id = worker_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.heartbeat_s = heartbeat_s
        self.mesh: MeshClient | None = None
        self.draining = False
        self.intake: list = []  # subscriptions that bring new work: drained first when stopping
        self._stopped = asyncio.Event()
        self._heartbeat_task: asyncio.Task | None = None
        self.started = False  # connected and set up

    # --- to override -------------------------------------------------------
    async def setup(self) -> None:
        """Subscribe handlers. Called once connected."""

    async def finish_inflight(self) -> None:
        """Called when stopping, while still connected: let in-flight work end (bounded)."""

    async def teardown(self) -> None:
        """Release resources after the connection is drained."""

    def load_report(self) -> LoadReport:
        return LoadReport(role=self.role, worker_id=self.worker_id)

    async def metric_families(self) -> list:
        """Prometheus metric families of the service's state, read at each scrape of its
        ``--metrics-port`` on the service's loop (``telemetry.metrics.ServiceCollector``)."""
        return metrics.service_families(self.role, self.worker_id, self.draining)

    # --- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        self.mesh = await MeshClient.connect(self.nats_url, name=self.worker_id)
        await self.setup()
        await self.mesh.nc.flush()
        self._heartbeat_task = asyncio.create_task(self._heartbeat())
        self.started = True
        log.info("service_started", role=self.role)

    def probe(self, path: str, loop: asyncio.AbstractEventLoop, timeout_s: float = 2.0) -> tuple[bool, dict]:
        """``/health``: the service's event loop runs a no-op within ``timeout_s`` (a stuck loop
        fails it: restart the process). ``/ready``: that, and connected to NATS, set up and not
        draining (take no traffic, do not restart). Called from the metrics server's thread."""
        try:
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout_s)
            alive = True
        except Exception:
            alive = False
        connected = self.mesh is not None and self.mesh.nc.is_connected
        body = {"role": self.role, "worker_id": self.worker_id, "loop": alive, "nats": connected,
                "started": self.started, "draining": self.draining}
        if path == "/health":
            return alive, body
        return alive and connected and self.started and not self.draining, body

    async def _heartbeat(self) -> None:
        while True:
            await self._publish_load()
            await asyncio.sleep(self.heartbeat_s)

    async def _publish_load(self) -> None:
        try:
            report = self.load_report()
            report.interval_s = self.heartbeat_s
            report.draining = self.draining
            await self.mesh.publish(subjects.load(self.role, self.worker_id), report)
        except Exception as e:  # NATS down: keep trying, the client reconnects
            log.warning("heartbeat_failed", error=str(e))

    async def stop_intake(self) -> None:
        """Drain the ``intake`` subscriptions: no new messages, the delivered ones are handled."""
        for sub in self.intake:
            try:
                await sub.drain()
            except Exception as e:  # connection closed or draining already
                log.warning("intake_drain_failed", error=str(e))
        self.intake.clear()

    async def drain(self) -> None:
        """Refuse new work, finish in-flight work, then drain the NATS connection."""
        self.draining = True
        log.info("service_draining", role=self.role)
        if self.mesh and self._heartbeat_task:  # routers learn it now, not at the next beat
            await self._publish_load()
        await self.stop_intake()
        await self.finish_inflight()
        if self._heartbeat_task:
            self._heartbeat_task.cancel()
        if self.mesh:
            try:  # NATS may be gone already (e.g. the whole mesh is stopping)
                await asyncio.wait_for(self.mesh.drain(), timeout=5)
            except Exception:
                await self.mesh.close()

    async def stop(self) -> None:
        if self.mesh and not self.mesh.nc.is_closed:
            await self.drain()
        await self.teardown()
        self._stopped.set()
        log.info("service_stopped", role=self.role)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


def run_service(service: Service, log_level: str = "INFO", metrics_port: int = 0) -> None:
    """Run ``service`` in this process until SIGINT / SIGTERM; serve its Prometheus metrics and its
    ``/health`` and ``/ready`` probes on ``metrics_port`` (0: none)."""
    configure_logging(service.role, service.worker_id, log_level)
    configure_tracing(service.role, service.worker_id)

    async def main():
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if metrics_port:
            metrics.start_metrics_server(metrics_port, metrics.ServiceCollector(service, loop),
                                         probes=lambda path: service.probe(path, loop))
        # NOTE: the NATS client retries an unreachable server forever (logging ``nats_error``):
        # SIGTERM / SIGINT end a service that never connected
        starting, stopping = asyncio.ensure_future(service.start()), asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            log.warning("service_stopped_before_connecting", role=service.role, nats=service.nats_url)
            return
        starting.result()  # a failed start raises here
        await stopping
        log.info("service_stopping", role=service.role)
        await service.stop()

    try:
        asyncio.run(main())
    finally:
        shutdown_tracing()  # flush spans still batched
