"""The AdminService gRPC handlers (SPEC M1): thin, validate → :class:`Admin` → contract.

Only an identity allowed any client reaches them (``turnstile_platform.authz.methods``
declares every AdminService method as the platform's); the caller's identity, as
the authorizer read it, goes into each change's audit entry.
"""

from __future__ import annotations

from typing import Any

import grpc.aio

from turnstile_admission import admin_validation as check
from turnstile_admission.admin import Admin, LimitsChange, keyset_document
from turnstile_clientkeys import KeySet
from turnstile_clientkeys.contract import KEY_KINDS
from turnstile_clientkeys.limits import LimitsConflictError
from turnstile_clientkeys.store import KeySetConflictError
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_platform.authz.ownership import current_identity

Context = grpc.aio.ServicerContext[Any, Any]


class AdminServicer(admission_pb2_grpc.AdminServiceServicer):
    def __init__(self, admin: Admin) -> None:
        self._admin = admin

    async def GetLimits(  # noqa: N802 - the gRPC method name
        self, request: admission_pb2.GetLimitsRequest, context: Context
    ) -> admission_pb2.GetLimitsResponse:
        name = check.target(request.target) if request.HasField("target") else None
        found = await self._admin.documents(name)
        return admission_pb2.GetLimitsResponse(
            documents=[
                admission_pb2.LimitsDocument(
                    target=check.target_of(field), name=field, limits=check.limits_message(doc)
                )
                for field, doc in found
            ]
        )

    async def SetLimits(  # noqa: N802
        self, request: admission_pb2.SetLimitsRequest, context: Context
    ) -> admission_pb2.SetLimitsResponse:
        name = check.target(request.target)
        document = check.limits(name, request.limits)
        try:
            change = await self._admin.set(name, document, current_identity())
        except LimitsConflictError as error:
            raise check.conflict(error) from error
        return admission_pb2.SetLimitsResponse(change=_change(change))

    async def PatchLimits(  # noqa: N802
        self, request: admission_pb2.PatchLimitsRequest, context: Context
    ) -> admission_pb2.PatchLimitsResponse:
        name = check.target(request.target)
        patch = check.patch(name, request.limits, list(request.update_mask.paths))
        try:
            change = await self._admin.patch(name, patch, current_identity())
        except LimitsConflictError as error:
            raise check.conflict(error) from error
        return admission_pb2.PatchLimitsResponse(change=_change(change))

    async def DeleteLimits(  # noqa: N802
        self, request: admission_pb2.DeleteLimitsRequest, context: Context
    ) -> admission_pb2.DeleteLimitsResponse:
        name = check.target(request.target)
        try:
            change = await self._admin.delete(name, current_identity())
        except LimitsConflictError as error:
            raise check.conflict(error) from error
        return admission_pb2.DeleteLimitsResponse(
            change=_change(change), deleted=change.previous is not None
        )

    async def GetKeySet(  # noqa: N802
        self, request: admission_pb2.GetKeySetRequest, context: Context
    ) -> admission_pb2.GetKeySetResponse:
        client_ids = check.resolve_ids(request.client_ids)
        keyset = await self._admin.keyset()
        return admission_pb2.GetKeySetResponse(
            key_set=_keyset(keyset),
            resolved=[
                admission_pb2.ResolvedClient(
                    client_id=client_id,
                    key=common_pb2.BoundedKey(
                        key=key.key, kind=KEY_KINDS[key.kind], key_set_version=key.version
                    ),
                )
                for client_id, key in self._admin.resolved(client_ids)
            ],
        )

    async def UpdateKeySet(  # noqa: N802
        self, request: admission_pb2.UpdateKeySetRequest, context: Context
    ) -> admission_pb2.UpdateKeySetResponse:
        wanted = check.keyset_change(request)
        try:
            before, after = await self._admin.update_keyset(
                wanted.allow, wanted.remove, wanted.flags, current_identity()
            )
        except KeySetConflictError as error:
            raise check.conflict(error) from error
        return admission_pb2.UpdateKeySetResponse(previous=_keyset(before), key_set=_keyset(after))


def _change(change: LimitsChange) -> admission_pb2.LimitsChange:
    out = admission_pb2.LimitsChange(warning=change.warning)
    if change.previous is not None:
        out.previous.CopyFrom(check.limits_message(change.previous))
    if change.current is not None:
        out.limits.CopyFrom(check.limits_message(change.current))
    return out


def _keyset(keyset: KeySet) -> admission_pb2.KeySet:
    doc = keyset_document(keyset)
    return admission_pb2.KeySet(
        version=doc["version"], allowlist=doc["allowlist"], flags=doc["flags"]
    )
