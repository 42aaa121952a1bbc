"""Server reflection under both ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``.

Current grpcurl and GUI clients ask ``grpc.reflection.v1`` first; grpcio-reflection
(1.85) ships only the ``v1alpha`` service. The two protocols are the same messages
under another package name (``v1`` was published as a copy of ``v1alpha``), so
the ``v1`` service is served by grpcio-reflection's own servicer over the
``v1alpha`` message classes, and the ``v1`` file descriptor (the ``v1alpha`` one
renamed) is added to the default pool so reflection can describe itself under
both names.

Every error the services send carries a ``google.rpc.Status`` with ``ErrorInfo``,
``BadRequest`` and other details (``errors.py``), but no service's ``.proto`` imports
``google/rpc/error_details.proto``: a tool that resolves types only from the files
reflection gives it for a method (``buf curl`` does; grpcurl asks for each type)
could print those details only as base64. So reflection describes each served
service's file as depending on ``google/rpc/status.proto`` and
``google/rpc/error_details.proto`` as well (what its errors carry), from a pool of
its own; the default pool and the generated code are untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
import grpc.aio
from google.protobuf import descriptor, descriptor_pb2, descriptor_pool
from google.rpc import error_details_pb2, status_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

V1ALPHA_SERVICE = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
#: The files a served service's errors carry types of (see the module's docstring).
ERROR_FILES = (status_pb2.DESCRIPTOR, error_details_pb2.DESCRIPTOR)


def _add_v1_descriptor() -> None:
    """Add the ``v1`` reflection file to the default pool (once per process)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    old, new = f".{reflection_pb2.DESCRIPTOR.package}.", f".{V1_PACKAGE}."
    file.name, file.package = _V1_FILE, V1_PACKAGE
    file.ClearField("options")
    for message in file.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for service in file.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    pool.Add(file)


def served_pool(service_names: Iterable[str]) -> descriptor_pool.DescriptorPool:
    """A pool of the services' files and their dependencies, in which each file that
    defines one of the services also depends on :data:`ERROR_FILES`."""
    default = descriptor_pool.Default()
    service_files: dict[str, descriptor.FileDescriptor] = {}
    for name in service_names:
        try:
            file = default.FindServiceByName(name).file
        except KeyError:
            continue  # not loaded in this process: nothing to describe
        service_files[file.name] = file
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: descriptor.FileDescriptor) -> None:
        if file.name in added:
            return
        extra = ERROR_FILES if file.name in service_files else ()
        for dependency in (*file.dependencies, *extra):
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        proto.dependency.extend(e.name for e in extra if e.name not in proto.dependency)
        pool.Add(proto)
        added.add(file.name)

    for file in service_files.values():
        add(file)
    return pool


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection for ``service_names`` (and itself) under v1 and v1alpha."""
    _add_v1_descriptor()
    names = [*service_names, V1_SERVICE, V1ALPHA_SERVICE]
    pool = served_pool(names)
    reflection.enable_server_reflection(names, server, pool=pool)
    servicer = ReflectionServicer(names, pool=pool)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": handler}),)
    )
