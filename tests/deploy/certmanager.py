"""Strict schemas of the cert-manager objects the manifests use (kubernetes-validate
ships only built-in kinds). A subset of cert-manager.io/v1, with unknown fields
rejected, so a misspelt field fails here as it would be refused by the CRD."""

from __future__ import annotations

from typing import Any

import jsonschema  # type: ignore[import-untyped]

from .manifests import Obj

CERT_MANAGER = "cert-manager.io/"

_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}
_ISSUER_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["Issuer", "ClusterIssuer"]},
        "group": {"type": "string"},
    },
    "additionalProperties": False,
}
_USAGES = ["server auth", "client auth", "digital signature", "key encipherment", "cert sign"]
_CERTIFICATE_SPEC = {
    "type": "object",
    "required": ["secretName", "issuerRef"],
    "properties": {
        "secretName": {"type": "string"},
        "issuerRef": _ISSUER_REF,
        "isCA": {"type": "boolean"},
        "commonName": {"type": "string"},
        "duration": {"type": "string", "pattern": "^[0-9]+h$"},
        "renewBefore": {"type": "string", "pattern": "^[0-9]+h$"},
        "dnsNames": {"type": "array", "items": {"type": "string"}},
        "uris": {"type": "array", "items": {"type": "string"}},
        "usages": {"type": "array", "items": {"enum": _USAGES}},
        "privateKey": {
            "type": "object",
            "properties": {
                "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                "size": {"type": "integer"},
                "rotationPolicy": {"enum": ["Never", "Always"]},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}
_ISSUER_SPEC = {
    "type": "object",
    "properties": {
        "selfSigned": {"type": "object", "additionalProperties": False},
        "ca": {
            "type": "object",
            "required": ["secretName"],
            "properties": {"secretName": {"type": "string"}},
            "additionalProperties": False,
        },
    },
    "minProperties": 1,
    "maxProperties": 1,
    "additionalProperties": False,
}


def _schema(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "cert-manager.io/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


SCHEMAS = {
    "Certificate": _schema("Certificate", _CERTIFICATE_SPEC),
    "Issuer": _schema("Issuer", _ISSUER_SPEC),
    "ClusterIssuer": _schema("ClusterIssuer", _ISSUER_SPEC),
}


def validate_cert_manager(obj: Obj) -> None:
    """Raise ``jsonschema.ValidationError`` (or KeyError for an unknown kind)."""
    jsonschema.validate(obj, SCHEMAS[obj["kind"]])
