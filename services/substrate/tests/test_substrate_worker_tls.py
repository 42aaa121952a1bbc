"""Sandbox runtimes get the sandbox-class certificate (SPEC Z1): on Kubernetes every
sandbox pod mounts one Secret read-only; the Direct substrate passes the files to the
processes it starts, or plaintext when it runs plaintext itself."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from turnstile_substrate.direct.substrate import DirectSubstrate, _worker_tls_sources
from turnstile_substrate.kubernetes import KubernetesSettings
from turnstile_substrate.kubernetes.template import WORKER_TLS_DIR, sandbox_pod, warm_pod
from turnstile_substrate.runtime import RuntimeSpec
from turnstile_substrate.settings import SubstrateSettings

SPEC = RuntimeSpec(sandbox_id="sb-1", tier="container", client_label="acme")


def _k8s(**values: Any) -> KubernetesSettings:
    return KubernetesSettings(**{"affinity_addr": "turnstile-affinity:50053", **values})


def test_every_sandbox_pod_mounts_the_sandbox_class_secret_read_only() -> None:
    settings = _k8s(worker_tls_secret="turnstile-sandbox-tls")
    for pod in (sandbox_pod(settings, SPEC), warm_pod(settings, "container")):
        kubernetes_validate.validate(pod, "1.31.0", strict=True)
        [container] = pod["spec"]["containers"]
        env = {var["name"]: var["value"] for var in container["env"]}
        assert env["TURNSTILE_WORKER_TLS_CERT_FILE"] == f"{WORKER_TLS_DIR}/tls.crt"
        assert env["TURNSTILE_WORKER_TLS_KEY_FILE"] == f"{WORKER_TLS_DIR}/tls.key"
        assert env["TURNSTILE_WORKER_TLS_CA_FILE"] == f"{WORKER_TLS_DIR}/ca.crt"
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["worker-tls"] == {
            "name": "worker-tls",
            "mountPath": WORKER_TLS_DIR,
            "readOnly": True,
        }
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["worker-tls"]["secret"]["secretName"] == "turnstile-sandbox-tls"


def test_without_a_secret_no_certificate_is_mounted() -> None:
    pod = sandbox_pod(_k8s(), SPEC)
    [container] = pod["spec"]["containers"]
    assert not any(var["name"].startswith("TURNSTILE_WORKER_TLS_") for var in container["env"])
    assert "worker-tls" not in {v["name"] for v in pod["spec"]["volumes"]}


def test_the_direct_substrate_passes_the_worker_certificate(tmp_path: Path) -> None:
    files = {name: tmp_path / name for name in ("worker.crt", "worker.key", "ca.crt")}
    settings = SubstrateSettings(
        plaintext=False,
        tls_ca_file=files["ca.crt"],
        direct_worker_tls_cert_file=files["worker.crt"],
        direct_worker_tls_key_file=files["worker.key"],
        # Its own uid: the files themselves (another uid gets the copy it can read,
        # test_substrate_direct_secrets.py).
        direct_runtime_user=str(os.getuid()),
        direct_state_dir=tmp_path / "direct",
    )
    assert _worker_tls_sources(settings) == (
        files["worker.crt"],
        files["worker.key"],
        files["ca.crt"],
    )
    env = DirectSubstrate(settings)._environment(SPEC, None)
    assert {name: env[name] for name in env if name.startswith("TURNSTILE_WORKER_TLS_")} == {
        "TURNSTILE_WORKER_TLS_CERT_FILE": str(files["worker.crt"]),
        "TURNSTILE_WORKER_TLS_KEY_FILE": str(files["worker.key"]),
        "TURNSTILE_WORKER_TLS_CA_FILE": str(files["ca.crt"]),
    }
    assert _worker_tls_sources(SubstrateSettings(plaintext=True)) is None
    plaintext = SubstrateSettings(
        plaintext=True, direct_runtime_user=str(os.getuid()), direct_state_dir=tmp_path / "d"
    )
    assert (
        DirectSubstrate(plaintext)._environment(SPEC, None)["TURNSTILE_WORKER_PLAINTEXT"] == "true"
    )
    with pytest.raises(ValueError, match="DIRECT_WORKER_TLS_CERT_FILE"):
        _worker_tls_sources(SubstrateSettings(plaintext=False, tls_ca_file=files["ca.crt"]))
