"""LedgerService servicer: transport only (authenticate, convert, call the ledger
operations, map domain errors through the one status table)."""

from __future__ import annotations

import time
from typing import Any

import grpc

from service._gen.retrieval.v1 import ledger_pb2, ledger_pb2_grpc
from service.api import ledger_convert as lc
from service.api.auth import Authenticator
from service.api.errors import abort_with
from service.app import App
from service.engines.base import EngineError
from service.errors import BackendFailure, DomainError, InvalidArgument, NotFound
from service.ledger.base import LedgerUnavailable
from service.ledger.operations import Caller
from service.pipeline.replay import replay
from service.pipeline.request import Principal

Context = grpc.aio.ServicerContext[Any, Any]


def _caller(principal: Principal) -> Caller:
    return Caller(principal.name, principal.unrestricted)


class LedgerServicer(ledger_pb2_grpc.LedgerServiceServicer):
    def __init__(self, app: App, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def GetRun(self, request: ledger_pb2.GetRunRequest, context: Context) -> ledger_pb2.Run:  # noqa: N802
        try:
            caller = _caller(self.auth.authenticate(context))
            view = await self.app.ledger_ops.get_run(request.run_id, request.page_size, request.page_token, caller)
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable") from None
        return lc.run_to_pb(view)

    async def ResolveGap(self, request: ledger_pb2.ResolveGapRequest, context: Context) -> ledger_pb2.Gap:  # noqa: N802
        try:
            principal = self.auth.authenticate(context)
            outcome = await self.app.ledger_ops.resolve_gap(
                request.run_id, request.gap_id, lc.resolution_from_pb(request, principal.name), _caller(principal))
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable") from None
        return lc.gap_to_pb(outcome.gap, self.app.cfg.critical_gap_threshold, outcome.rejected)

    async def ValidateCitations(  # noqa: N802
        self, request: ledger_pb2.ValidateCitationsRequest, context: Context
    ) -> ledger_pb2.ValidateCitationsResponse:
        try:
            caller = _caller(self.auth.authenticate(context))
            checks = await self.app.ledger_ops.validate_citations(request.run_id, list(request.evidence_ids), caller)
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable") from None
        return ledger_pb2.ValidateCitationsResponse(citations=[lc.citation_to_pb(c) for c in checks],
                                                    all_valid=all(c.valid for c in checks))

    async def ReplayAttempt(  # noqa: N802
        self, request: ledger_pb2.ReplayAttemptRequest, context: Context
    ) -> ledger_pb2.ReplayAttemptResponse:
        try:
            principal = self.auth.authenticate(context)
            if not request.attempt_id:
                raise InvalidArgument.one("attempt_id", "must not be empty")
            await self.app.writer.flush(2.0)
            remaining = context.time_remaining()
            deadline = time.monotonic() + (self.app.cfg.default_deadline_s if remaining is None else min(remaining, 3600.0))
            try:
                result = await replay(self.app.ledger, self.app.engine, self.app.runner, request.attempt_id,
                                      rerun=request.rerun, principal=principal, deadline=deadline)
            except LedgerUnavailable as exc:
                raise BackendFailure(f"ledger unavailable: {exc}") from exc
            except EngineError as exc:
                raise BackendFailure(f"engine {self.app.engine.name}: {exc}") from exc
            if result is None:
                raise NotFound(f"no attempt {request.attempt_id!r}")
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable") from None
        return lc.replay_to_pb(result)

    async def PurgeRun(self, request: ledger_pb2.PurgeRunRequest, context: Context) -> ledger_pb2.PurgeRunResponse:  # noqa: N802
        try:
            principal = self.auth.authenticate(context)
            report = await self.app.ledger_ops.purge(request.run_id, request.reason, _caller(principal))
        except DomainError as exc:
            await abort_with(context, exc)
            raise AssertionError("unreachable") from None
        return ledger_pb2.PurgeRunResponse(purge=lc.purge_to_pb(report))
