"""The grpc.aio server: servicers, health (SERVING only once models and engine are
ready), reflection, and graceful shutdown (drain in-flight calls on SIGTERM/SIGINT)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, ledger_pb2, ledger_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from service.api.auth import Authenticator
from service.api.ledger_servicer import LedgerServicer
from service.api.servicers import Admission, CorpusServicer, RetrievalServicer
from service.app import App

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    retrieval_pb2.DESCRIPTOR.services_by_name["RetrievalService"].full_name,
    corpus_pb2.DESCRIPTOR.services_by_name["CorpusService"].full_name,
    ledger_pb2.DESCRIPTOR.services_by_name["LedgerService"].full_name,
)
# Health name that stays SERVING while the process answers at all: liveness probes use it,
# so an OpenSearch outage (readiness) never makes an orchestrator restart healthy pods.
LIVENESS_SERVICE = "liveness"
_HEALTH_POLL_S = 1.0
_GRACE_S = 5.0


class Server:
    def __init__(self, app: App) -> None:
        self.app = app
        self.auth = Authenticator.from_file(app.cfg.api_keys_file)
        self.admission = Admission(app)
        self.health = health.aio.HealthServicer()
        self.grpc = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.so_reuseport", 0),
        ])
        retrieval_pb2_grpc.add_RetrievalServiceServicer_to_server(
            RetrievalServicer(app, self.auth, self.admission), self.grpc)
        corpus_pb2_grpc.add_CorpusServiceServicer_to_server(
            CorpusServicer(app, self.auth, self.admission), self.grpc)
        ledger_pb2_grpc.add_LedgerServiceServicer_to_server(LedgerServicer(app, self.auth), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.grpc)
        self.port = 0
        self.metrics_port = 0  # the /metrics port once started with metrics_listen
        self._watch: asyncio.Task[None] | None = None

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def _watch_engine(self) -> None:
        last: bool | None = None
        while True:
            ready = await self.app.engine.ready()
            if ready != last:
                log.info("engine %s is %s", self.app.engine.name, "ready" if ready else "NOT ready")
                await self._set_health(ready)
                last = ready
            await asyncio.sleep(_HEALTH_POLL_S)

    async def start(self, listen: str) -> int:
        """Bind first (health answers NOT_SERVING while models load), then start the app."""
        self.port = self.grpc.add_insecure_port(listen)
        await self._set_health(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.grpc.start()
        self.app.metrics.start_lag_probe()
        if self.app.cfg.metrics_listen:
            self.metrics_port = self.app.metrics.serve(self.app.cfg.metrics_listen)
        await self.app.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_engine())
        return self.port

    async def stop(self, grace_s: float = _GRACE_S) -> None:
        self.admission.draining = True
        await self._set_health(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self.grpc.stop(grace_s)
        await self.app.close()
        await self.app.metrics.close()


async def serve(
    app: App, listen: str, on_ready: Callable[[str], Awaitable[None]] | None = None
) -> None:
    """Serve until SIGTERM/SIGINT; ``on_ready`` runs once with the bound address."""
    server = Server(app)
    port = await server.start(listen)
    host = listen.rsplit(":", 1)[0]
    if on_ready is not None:
        await on_ready(f"{host}:{port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining in-flight calls for up to %.0fs", _GRACE_S)
    await server.stop()
