"""Pod-specific registry rules: defaulting, validation, and what an update may change.

These mirror the pod strategy in ``pkg/registry/core/pod`` closely enough that code which works
against the emulator also works against a real API server on the paths Turnstile uses:

* create drops client-supplied ``status`` and sets ``phase: Pending`` plus the computed QoS class;
* an update of the main resource keeps the stored ``status`` (status is written through the
  ``/status`` subresource), and a status update keeps everything but ``status``;
* ``spec`` is immutable except container images, ``activeDeadlineSeconds``, ``tolerations`` and
  ``schedulingGates``; in particular ``spec.nodeName`` cannot be set by an update (the scheduler
  binds through a subresource; tests use :meth:`KubeEmulator.set_node_name`);
* names must be DNS-1123 subdomains and label keys/values must be valid, or the request is a 422.

Simplified: defaulting covers the commonly read fields only; no admission plugins run (no
service-account token volume is injected); validation covers names, labels and containers only.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from turnstile_testing.kube_emulator.errors import ApiError, invalid
from turnstile_testing.kube_emulator.selectors import validate_label_key, validate_label_value

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # apimachinery's utilrand alphabet
_MUTABLE_SPEC_FIELDS = ("activeDeadlineSeconds", "tolerations", "schedulingGates")


def generate_name(prefix: str) -> str:
    """``generateName`` + five random characters, as ``names.SimpleNameGenerator`` does."""
    base = prefix[: 63 - 5] if len(prefix) > 58 else prefix
    return base + "".join(secrets.choice(_GENERATE_ALPHABET) for _ in range(5))


def validate_name(name: str) -> None:
    """A DNS-1123 subdomain, or the 422 the API server returns (pods, leases)."""
    if not name:
        raise invalid("", "metadata.name", "Required value: name or generateName is required")
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise invalid(
            name,
            "metadata.name",
            f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower case '
            "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric "
            "character",
        )


def validate_metadata(pod: dict[str, Any]) -> None:
    """Reject invalid names and labels with the 422 the API server would return."""
    meta = pod["metadata"]
    name = meta.get("name", "")
    validate_name(name)
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        raise invalid(name, "metadata.labels", "Invalid value: labels must be a map")
    for key, value in labels.items():
        try:
            validate_label_key(key)
            if not isinstance(value, str):
                raise invalid(
                    name, "metadata.labels", f"Invalid value: {value!r}: must be a string"
                )
            validate_label_value(value)
        except ApiError as exc:
            if exc.code == 422:
                raise
            detail = exc.message.removeprefix("unable to parse requirement: ")
            raise invalid(name, "metadata.labels", detail) from None
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict) or not all(
        isinstance(v, str) for v in annotations.values()
    ):
        raise invalid(name, "metadata.annotations", "Invalid value: values must be strings")


def validate_spec(pod: dict[str, Any]) -> None:
    """A pod needs at least one container, each with a name and an image."""
    name = pod["metadata"].get("name", "")
    containers = (pod.get("spec") or {}).get("containers")
    if not isinstance(containers, list) or not containers:
        raise invalid(name, "spec.containers", "Required value")
    for i, container in enumerate(containers):
        if not isinstance(container, dict) or not container.get("name"):
            raise invalid(name, f"spec.containers[{i}].name", "Required value")
        if not container.get("image"):
            raise invalid(name, f"spec.containers[{i}].image", "Required value")


def qos_class(spec: dict[str, Any]) -> str:
    """The pod's QoS class from container requests/limits (cpu and memory only)."""
    containers = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    any_set = False
    guaranteed = True
    for container in containers:
        resources = container.get("resources") or {}
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        if limits or requests:
            any_set = True
        for resource in ("cpu", "memory"):
            if (
                resource not in limits
                or requests.get(resource, limits[resource]) != limits[resource]
            ):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def apply_create_defaults(pod: dict[str, Any]) -> None:
    """Defaults the API server fills on create, for the fields clients commonly read."""
    spec = pod.setdefault("spec", {})
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    spec.setdefault("priority", 0)
    for container in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
        if not isinstance(container, dict):
            continue
        image = str(container.get("image", ""))
        tag = image.rsplit("/", 1)[-1]
        latest = ":" not in tag or tag.endswith(":latest")
        container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        container.setdefault("resources", {})
    pod["status"] = {"phase": "Pending", "qosClass": qos_class(spec)}


def _spec_without_mutable(spec: dict[str, Any]) -> dict[str, Any]:
    trimmed = {k: v for k, v in spec.items() if k not in _MUTABLE_SPEC_FIELDS}
    for field in ("containers", "initContainers"):
        if isinstance(trimmed.get(field), list):
            trimmed[field] = [
                {k: v for k, v in c.items() if k != "image"} if isinstance(c, dict) else c
                for c in trimmed[field]
            ]
    return trimmed


def check_spec_update(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Reject spec changes the pod update validation forbids."""
    old_spec = old.get("spec") or {}
    new_spec = new.get("spec") or {}
    if _spec_without_mutable(old_spec) != _spec_without_mutable(new_spec):
        raise invalid(
            new["metadata"].get("name", ""),
            "spec",
            "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
            "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` "
            "(only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
            "(allow it to be set to 1 if it was previously negative)",
        )
