"""Pod Security admission (``baseline`` and ``restricted``, latest) for pods created over HTTP.

The manifests label the sandbox namespace ``pod-security.kubernetes.io/enforce: restricted``,
so a pod the substrate makes that breaks the profile is refused by a real API server with
403 Forbidden. The emulator applies the same checks (``k8s.io/pod-security-admission``'s
``policy`` package, the ones a pod spec can fail) and the same message shape:
``pods "x" is forbidden: violates PodSecurity "restricted:latest": <check> (<detail>), ...``.

Not covered: AppArmor and SELinux options, sysctls, Windows host process — the substrate sets
none of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from turnstile_testing.kube_emulator.errors import ApiError

#: Capabilities the baseline profile lets a container add (``capabilities_baseline.go``).
_BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
#: Volume types the restricted profile allows (``restrictedVolumes.go``).
_RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
_SECCOMP_OK = frozenset({"RuntimeDefault", "Localhost"})


def _containers(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for container in spec.get(field) or []:
            if isinstance(container, dict):
                yield container


def _quoted(names: list[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def _which(names: list[str]) -> str:
    return f"container{'s' if len(names) > 1 else ''} {_quoted(names)}"


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    """The baseline checks a pod fails, as ``check (detail)`` strings."""
    spec = pod.get("spec") or {}
    found: list[str] = []
    hosts = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if hosts:
        found.append(f"host namespaces ({', '.join(hosts)})")
    containers = list(_containers(spec))
    privileged = [
        c.get("name", "")
        for c in containers
        if (c.get("securityContext") or {}).get("privileged") is True
    ]
    if privileged:
        found.append(
            f"privileged ({_which(privileged)} must not set securityContext.privileged=true)"
        )
    added: list[str] = []
    for c in containers:
        caps = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
        added += [cap for cap in caps if cap not in _BASELINE_CAPABILITIES]
    if added:
        found.append(f"non-default capabilities (capabilities {_quoted(added)} must not be added)")
    host_paths = [v.get("name", "") for v in spec.get("volumes") or [] if "hostPath" in v]
    if host_paths:
        found.append(f"hostPath volumes (volumes {_quoted(host_paths)})")
    ports = [
        str(p["hostPort"])
        for c in containers
        for p in c.get("ports") or []
        if isinstance(p, dict) and p.get("hostPort")
    ]
    if ports:
        found.append(f"hostPort (hostPorts {', '.join(ports)})")
    pod_seccomp = ((spec.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        found.append(
            'seccompProfile (pod must not set securityContext.seccompProfile.type to "Unconfined")'
        )
    unmasked = [
        c.get("name", "")
        for c in containers
        if (c.get("securityContext") or {}).get("procMount") not in (None, "Default")
    ]
    if unmasked:
        found.append(f"procMount ({_which(unmasked)} must not set securityContext.procMount)")
    return found


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The baseline and restricted checks a pod fails."""
    found = baseline_violations(pod)
    spec = pod.get("spec") or {}
    pod_context = spec.get("securityContext") or {}
    containers = list(_containers(spec))
    restricted_volumes = [
        f'volume "{v.get("name", "")}" uses restricted volume type "{kind}"'
        for v in spec.get("volumes") or []
        for kind in v
        if kind != "name" and kind not in _RESTRICTED_VOLUMES
    ]
    if restricted_volumes:
        found.append(f"restricted volume types ({', '.join(restricted_volumes)})")
    escalating = [
        c.get("name", "")
        for c in containers
        if (c.get("securityContext") or {}).get("allowPrivilegeEscalation") is not False
    ]
    if escalating:
        found.append(
            f"allowPrivilegeEscalation != false ({_which(escalating)} must set "
            "securityContext.allowPrivilegeEscalation=false)"
        )
    not_dropping = [
        c.get("name", "")
        for c in containers
        if "ALL"
        not in (((c.get("securityContext") or {}).get("capabilities") or {}).get("drop") or [])
    ]
    adding = [
        c.get("name", "")
        for c in containers
        if any(
            cap != "NET_BIND_SERVICE"
            for cap in ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
        )
    ]
    if not_dropping or adding:
        parts = []
        if not_dropping:
            parts.append(
                f'{_which(not_dropping)} must set securityContext.capabilities.drop=["ALL"]'
            )
        if adding:
            parts.append(
                f"{_which(adding)} must not include capabilities other than "
                '"NET_BIND_SERVICE" in securityContext.capabilities.add'
            )
        found.append(f"unrestricted capabilities ({'; '.join(parts)})")
    pod_non_root = pod_context.get("runAsNonRoot") is True
    not_non_root = [
        c.get("name", "")
        for c in containers
        if (c.get("securityContext") or {}).get("runAsNonRoot") is False
        or (not pod_non_root and (c.get("securityContext") or {}).get("runAsNonRoot") is not True)
    ]
    if not_non_root:
        found.append(
            f"runAsNonRoot != true (pod or {_which(not_non_root)} must set "
            "securityContext.runAsNonRoot=true)"
        )
    root_users = (["pod"] if pod_context.get("runAsUser") == 0 else []) + [
        f'container "{c.get("name", "")}"'
        for c in containers
        if (c.get("securityContext") or {}).get("runAsUser") == 0
    ]
    if root_users:
        found.append(f"runAsUser=0 ({' and '.join(root_users)} must not set runAsUser=0)")
    pod_seccomp = (pod_context.get("seccompProfile") or {}).get("type")
    no_seccomp = [
        c.get("name", "")
        for c in containers
        if ((c.get("securityContext") or {}).get("seccompProfile") or {}).get("type")
        not in _SECCOMP_OK
        and not (
            pod_seccomp in _SECCOMP_OK
            and ((c.get("securityContext") or {}).get("seccompProfile") or {}).get("type") is None
        )
    ]
    if no_seccomp:
        found.append(
            f"seccompProfile (pod or {_which(no_seccomp)} must set "
            'securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")'
        )
    return found


def check_pod_security(level: str, pod: dict[str, Any]) -> None:
    """Refuse (403 Forbidden) a pod that violates ``level`` (privileged allows anything)."""
    if level == "privileged":
        return
    found = restricted_violations(pod) if level == "restricted" else baseline_violations(pod)
    if not found:
        return
    name = str((pod.get("metadata") or {}).get("name") or "")
    raise ApiError(
        403,
        f'pods "{name}" is forbidden: violates PodSecurity "{level}:latest": {", ".join(found)}',
        "Forbidden",
        {"name": name, "kind": "pods"},
    )
