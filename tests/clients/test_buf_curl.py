"""A third-party gRPC client against the real stack over mutual TLS: ``buf curl``
(``buf-bin``, in the workspace) lists the services through reflection and calls a
method with JSON, and the rich error details of a refusal can be decoded from what
reflection serves alone.

Every error carries ``google.rpc`` details (``ErrorInfo``, ``BadRequest`` …), so
reflection describes each service's file as depending on ``google/rpc/status.proto``
and ``google/rpc/error_details.proto``: a client that loads a method's files
through reflection (buf curl's resolver, grpcurl, GUI clients) has the detail types
with them. ``buf curl`` itself prints a detail decoded (its ``debug`` field) only
for types compiled into the buf binary, which has no ``google.rpc`` types: it shows
their bytes, and the test decodes those bytes with the types reflection served.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from turnstile_testing.stack import RunningStack, run_stack

BUF = Path(sys.executable).with_name("buf")
PLACE = "turnstile.affinity.v1.AffinityService/Place"
SERVER_NAME = "affinity.service.turnstile.local"


async def buf_curl(stack: RunningStack, *args: str) -> subprocess.CompletedProcess[str]:
    tls = stack.tls_dir
    command = [
        str(BUF),
        "curl",
        "--protocol",
        "grpc",
        "--cacert",
        str(tls / "ca.crt"),
        "--cert",
        str(tls / "cli.crt"),
        "--key",
        str(tls / "cli.key"),
        "--servername",
        SERVER_NAME,
        *args,
    ]
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60
    )


async def reflected_pool(stack: RunningStack, symbol: str) -> descriptor_pool.DescriptorPool:
    """A pool of the files reflection serves for ``symbol`` and nothing else."""
    async with stack.channel(stack.addresses[2]) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        async for response in stub.ServerReflectionInfo(iter([request])):
            for raw in response.file_descriptor_response.file_descriptor_proto:
                file = descriptor_pb2.FileDescriptorProto.FromString(raw)
                files[file.name] = file
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(name: str) -> None:
        if name in added:
            return
        for dependency in files[name].dependency:
            add(dependency)  # KeyError: reflection left a dependency out
        pool.Add(files[name])
        added.add(name)

    for name in files:
        add(name)
    return pool


def error_json(stderr: str) -> dict[str, object]:
    """The error buf curl prints on stderr, without its verbose ``buf:`` lines."""
    body = "\n".join(line for line in stderr.splitlines() if not line.startswith("buf: "))
    parsed: dict[str, object] = json.loads(body)
    return parsed


@pytest.mark.timeout(120)
async def test_buf_curl_calls_over_mtls_and_reflection_serves_the_error_types(
    tmp_path: Path,
    redis: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    database_url: str,
) -> None:
    assert BUF.exists(), "buf (PyPI's buf-bin) is not installed in the workspace"
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        url = f"https://{stack.addresses[2]}"
        listed = await buf_curl(stack, "--list-services", url)
        assert listed.returncode == 0, listed.stderr
        assert "turnstile.affinity.v1.AffinityService" in listed.stdout.split()

        # A Place without its client: INVALID_ARGUMENT with ErrorInfo and BadRequest.
        refused = await buf_curl(
            stack, "-v", "-d", '{"session_id": "chat-1", "tier": "container"}', f"{url}/{PLACE}"
        )
        pool = await reflected_pool(stack, "turnstile.affinity.v1.AffinityService")
    assert refused.returncode == grpc.StatusCode.INVALID_ARGUMENT.value[0] * 8, refused.stderr
    for served in ("google/rpc/status.proto", "google/rpc/error_details.proto"):
        assert f'Server reflection has resolved file "{served}"' in refused.stderr
    error = error_json(refused.stderr)
    assert error["code"] == "invalid_argument"
    details = error["details"]
    assert isinstance(details, list)
    by_type = {detail["type"]: base64.b64decode(detail["value"] + "==") for detail in details}

    def decoded(name: str) -> object:
        cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
        return cls.FromString(by_type[name])

    info = decoded("google.rpc.ErrorInfo")
    assert info.domain == "turnstile.dev"  # type: ignore[attr-defined]
    bad = decoded("google.rpc.BadRequest")
    (violation,) = bad.field_violations  # type: ignore[attr-defined]
    assert violation.field == "client_id"
    assert violation.description.startswith("required")
    assert "SPEC" not in violation.description
