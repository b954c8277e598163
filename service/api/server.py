"""The grpc.aio server: servicers, health (SERVING only once models and engine are
ready), reflection, and graceful shutdown.

Graceful stop (SIGTERM or SIGINT): health turns NOT_SERVING at once and new attempts and
ingest streams are refused with UNAVAILABLE while the server still answers (so probes and
callers see why); in-flight attempts and ingest streams get ``shutdown_grace_s`` to finish;
then the gRPC server stops (cancelling whatever is left), the ledger writer is flushed and
the engine, models and ledger are closed. A second signal cuts the wait short: in-flight
calls are cancelled at once and the process exits after closing the app."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service._gen.retrieval.v1 import corpus_pb2, corpus_pb2_grpc, ledger_pb2, ledger_pb2_grpc, retrieval_pb2, retrieval_pb2_grpc
from service.api.auth import Authenticator
from service.api.ledger_servicer import LedgerServicer
from service.api.admission import Admission
from service.api.quotas import Limits
from service.api.reflection_pool import MethodAwarePool
from service.api.servicers import CorpusServicer, RetrievalServicer
from service.api.undecodable import RejectUndecodable
from service.api.transport_security import check_exposure, server_credentials
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


class Server:
    def __init__(self, app: App) -> None:
        self.app = app
        cfg = app.cfg
        self.auth = Authenticator.from_file(cfg.api_keys_file, Limits(
            cfg.anonymous_requests_per_second, cfg.anonymous_burst, cfg.anonymous_max_concurrent,
            cfg.anonymous_max_searches_per_run), client_certs=bool(cfg.tls_client_ca_file))
        self.admission = Admission(app, self.auth.quotas)
        self.health = health.aio.HealthServicer()
        self.grpc = grpc.aio.server(interceptors=[RejectUndecodable()], options=[
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
             reflection.SERVICE_NAME), self.grpc, pool=MethodAwarePool())
        self.port = 0
        self.metrics_port = 0  # the /metrics port once started with metrics_listen
        self._watch: asyncio.Task[None] | None = None
        self._stop_now = asyncio.Event()

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
        """Bind first (health answers NOT_SERVING while models load), then start the app.
        Raises ExposureError before binding a non-loopback address without auth."""
        log.info("%s", check_exposure(self.app.cfg, listen))
        credentials = server_credentials(self.app.cfg)
        if credentials is None:
            self.port = self.grpc.add_insecure_port(listen)
        else:
            self.port = self.grpc.add_secure_port(listen, credentials)
        await self._set_health(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.grpc.start()
        self.app.metrics.start_lag_probe()
        if self.app.cfg.metrics_listen:
            self.metrics_port = self.app.metrics.serve(self.app.cfg.metrics_listen)
        await self.app.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_engine())
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain, then close (see the module doc); ``stop_now`` cuts the drain short."""
        grace_s = self.app.cfg.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace_s
        self.admission.draining = True
        if self._watch is not None:  # first: it must not turn health back to SERVING
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._set_health(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        idle = asyncio.ensure_future(self.admission.wait_idle(grace_s))
        now = asyncio.ensure_future(self._stop_now.wait())
        await asyncio.wait({idle, now}, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        now.cancel()
        left = 0.0 if self._stop_now.is_set() else max(0.0, deadline - time.monotonic())
        if self.admission.inflight or self.admission.streams:
            log.warning("stopping with %d attempts and %d ingest streams still in flight: cancelled",
                        self.admission.inflight, self.admission.streams)
        await self.grpc.stop(left)  # other in-flight calls (ledger RPCs, ...) get what is left
        await self.app.close()
        await self.app.metrics.close()
        log.info("stopped: ledger writer flushed (%d records written, %d dropped), engine closed",
                 self.app.writer.written, self.app.writer.dropped)

    def stop_now(self) -> None:
        """A second signal: cancel in-flight calls instead of waiting for them."""
        self._stop_now.set()


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

    def on_signal() -> None:
        if stop.is_set():
            log.warning("second stop signal: cancelling in-flight calls now")
            server.stop_now()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    log.info("shutting down: NOT_SERVING; in-flight attempts and ingest streams get up to %.1fs "
             "(a second SIGTERM stops at once)", app.cfg.shutdown_grace_s)
    await server.stop()
