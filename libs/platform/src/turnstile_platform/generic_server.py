"""A grpc.aio server that serves every method through its generic handlers.

Why: grpcio 1.85's aio server main loop (``AioServer._server_main_loop`` in
``grpc/_cython/_cygrpc/aio/server.pyx.pxi``) keeps one pending request-call
future per *registered* method plus one for all generic (unregistered) methods,
and for every incoming call awaits ``asyncio.wait`` over all of them. The
generated ``add_*Servicer_to_server`` functions (ours, health's, reflection's)
register each method both ways, so a service's server (its 5 methods, health's
3, reflection v1alpha's 1, plus the generic one) waited on ten futures per call
where one does the same work (docs/performance.md measures the difference).

The generated functions always add a generic handler holding the very same
method handlers before registering them, so dropping the registration loses
nothing: every method is still resolved, by grpcio's ``_MethodResolver``, from
the generic handlers, and each lookup returns the same handler object every
time (the platform interceptor's per-method cache relies on that identity).

Re-check on a grpcio upgrade:

- that the main loop still waits on one future per registered method (if it
  stopped, this wrapper buys nothing and can go);
- that generated ``add_*_to_server`` still calls ``add_generic_rpc_handlers``
  with every method (if it only registered them, this wrapper would leave the
  methods UNIMPLEMENTED: the service suites would fail);
- that :class:`grpc.aio.Server` grew no method this wrapper lacks: an abstract
  one fails its instantiation (loud), but a concrete one with a default body,
  as ``add_registered_method_handlers`` itself has, would be inherited rather
  than delegated (silent).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import grpc.aio


class GenericOnlyServer(grpc.aio.Server):
    """A :class:`grpc.aio.Server` whose ``add_registered_method_handlers`` does nothing.

    Everything else is delegated to the grpc.aio server it wraps. Services add
    their servicers as usual, with the generated ``add_*_to_server(servicer,
    server)``; see the module docstring for why registration is dropped.
    """

    def __init__(self, inner: grpc.aio.Server) -> None:
        self._inner = inner

    def add_generic_rpc_handlers(
        self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler[Any, Any]]
    ) -> None:
        self._inner.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        """Do nothing: the generic handler added alongside serves these methods.

        Registering them would add one future per method to the ``asyncio.wait``
        grpcio's main loop runs for every call (module docstring).
        """

    def add_insecure_port(self, address: str) -> int:
        return self._inner.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._inner.add_secure_port(address, server_credentials)

    async def start(self) -> None:
        await self._inner.start()

    async def stop(self, grace: float | None = None) -> None:
        await self._inner.stop(grace)

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        return await self._inner.wait_for_termination(timeout)


def server(
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] | None = None,  # type: ignore[type-arg]
    options: Sequence[tuple[str, Any]] | None = None,
    maximum_concurrent_rpcs: int | None = None,
) -> GenericOnlyServer:
    """A new grpc.aio server (arguments as :func:`grpc.aio.server`), generic handlers only."""
    return GenericOnlyServer(
        grpc.aio.server(
            interceptors=interceptors,
            options=options,
            maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        )
    )
