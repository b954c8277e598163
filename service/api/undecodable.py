"""Requests that are not valid protobuf at the wire level (e.g. a string field with bytes
that are not UTF-8) are INVALID_ARGUMENT, not an unhandled DecodeError (which grpc reports
as UNKNOWN). A server interceptor swaps every method's request deserializer for one that
returns a marker instead of raising, and answers the marker with INVALID_ARGUMENT (for
streams, at the message that could not be decoded)."""

from __future__ import annotations

import contextlib

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from service.api.errors import abort_with
from service.errors import InvalidArgument


class Undecodable:
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _safe(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError and friends: the caller's bytes, not our bug
            return Undecodable(str(exc))
    return decode


async def _reject(context: Any, bad: Undecodable) -> None:
    await abort_with(context, InvalidArgument.one("request", f"not a valid protobuf message: {bad.reason}"))


async def _checked(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            await _reject(context, request)
        yield request


if TYPE_CHECKING:  # generic only in the type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]


class RejectUndecodable(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        # method -> (its handler, the wrapper): servicers' handlers live as long as the server
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        cached = self._wrapped.get(handler_call_details.method)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[handler_call_details.method] = (handler, self._wrap(handler))
        return cached[1]

    def _wrap(self, handler: Handler) -> Handler:
        assert handler.request_deserializer is not None
        decode = _safe(handler.request_deserializer)
        encode = handler.response_serializer
        if handler.unary_unary is not None:
            inner_uu: Any = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                if isinstance(request, Undecodable):
                    await _reject(context, request)
                return await inner_uu(request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, decode, encode)
        if handler.unary_stream is not None:
            inner_us: Any = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                if isinstance(request, Undecodable):
                    await _reject(context, request)
                async with contextlib.aclosing(inner_us(request, context)) as responses:  # cancel reaches it at once
                    async for response in responses:
                        yield response
            return grpc.unary_stream_rpc_method_handler(unary_stream, decode, encode)
        if handler.stream_unary is not None:
            inner_su: Any = handler.stream_unary

            async def stream_unary(requests: AsyncIterator[Any], context: Any) -> Any:
                return await inner_su(_checked(requests, context), context)
            return grpc.stream_unary_rpc_method_handler(stream_unary, decode, encode)
        inner_ss: Any = handler.stream_stream

        async def stream_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async with contextlib.aclosing(inner_ss(_checked(requests, context), context)) as responses:
                async for response in responses:
                    yield response
        return grpc.stream_stream_rpc_method_handler(stream_stream, decode, encode)
