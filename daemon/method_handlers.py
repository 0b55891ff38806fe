"""How a server interceptor puts code around every method: the same kind of handler with the same
serializers, its behavior wrapped. The error table (daemon/grpc_errors.py) and the peer check
(daemon/peer_auth.py) both wrap this way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def wrapped(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior], Behavior]) -> grpc.RpcMethodHandler:
    """`handler` with its behavior replaced by `wrap(behavior)`."""
    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **serializers)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **serializers)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **serializers)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **serializers)


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the behavior of every method on the server with `wrap(behavior, method name)`."""

    def __init__(self, wrap: Callable[[Behavior, str], Behavior]) -> None:
        self._wrap = wrap

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return wrapped(handler, lambda behavior: self._wrap(behavior, method))
