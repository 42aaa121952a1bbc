"""mTLS and authorization in the manifests (SPEC Z1, Z2, Z4, Z5): every service
mounts its own cert-manager certificate and the policy, the certificates carry the
SPIFFE IDs the policy names, sandbox pods get the sandbox class and nothing more,
no kustomization turns plaintext on, and production carries no dev credentials."""

from __future__ import annotations

import base64
from collections.abc import Callable

import pytest

from turnstile_platform.authz.methods import all_methods
from turnstile_platform.authz.policy import parse_policy
from turnstile_platform.identity import server_name

from .manifests import REPO_ROOT, SERVICES, Obj, config_map, containers, named, of_kind, workloads

Built = Callable[[str], list[Obj]]
TD = "spiffe://turnstile.local"
STACK_POLICY = REPO_ROOT / "tools/turnstilectl/src/turnstile_cli/stack/authz-policy.toml"
TLS_FILES = {
    "TURNSTILE_TLS_CERT_FILE": "/etc/turnstile/tls/tls.crt",
    "TURNSTILE_TLS_KEY_FILE": "/etc/turnstile/tls/tls.key",
    "TURNSTILE_TLS_CA_FILE": "/etc/turnstile/tls/ca.crt",
    "TURNSTILE_AUTHZ_POLICY_FILE": "/etc/turnstile/policy/authz-policy.toml",
}


def _template(objects: list[Obj], service: str) -> Obj:
    spec: Obj = named(objects, "Deployment", f"turnstile-{service}")["spec"]["template"]
    return spec


@pytest.mark.parametrize("name", ["base", "dev", "production"])
def test_every_service_mounts_its_certificate_and_the_policy(built: Built, name: str) -> None:
    objects = built(name)
    settings = config_map(objects, "turnstile-config")["data"]
    assert {k: settings.get(k) for k in TLS_FILES} == TLS_FILES
    policy_map = config_map(objects, "turnstile-authz-policy")
    for service in SERVICES:
        template = _template(objects, service)
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == f"turnstile-{service}-tls"
        assert volumes["authz-policy"]["configMap"]["name"] == policy_map["metadata"]["name"]
        (container,) = template["spec"]["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["tls"]["mountPath"] == "/etc/turnstile/tls"
        assert mounts["authz-policy"]["mountPath"] == "/etc/turnstile/policy"
        assert all(mounts[n].get("readOnly") for n in ("tls", "authz-policy"))
        cert = named(objects, "Certificate", f"turnstile-{service}")["spec"]
        assert cert["secretName"] == f"turnstile-{service}-tls"
        assert cert["uris"] == [f"{TD}/service/{service}"]
        assert f"turnstile-{service}" in cert["dnsNames"]
        # The name every Turnstile client checks (SPEC O5): derived from the SPIFFE ID.
        assert server_name(f"{TD}/service/{service}") in cert["dnsNames"]
        assert cert["usages"] == ["server auth", "client auth"]
        assert cert["privateKey"]["rotationPolicy"] == "Always"


@pytest.mark.parametrize("name", ["base", "dev", "production"])
def test_no_kustomization_runs_plaintext(built: Built, name: str) -> None:
    """The production overlay cannot start without mTLS: nothing sets plaintext, the
    certificate files are set, and the services refuse to start without them."""
    objects = built(name)
    for cm in of_kind(objects, "ConfigMap"):
        assert "TURNSTILE_PLAINTEXT" not in cm.get("data", {}), cm["metadata"]["name"]
    for _, template in workloads(objects):
        for container in containers(template):
            names = {e["name"] for e in container.get("env", [])}
            assert "TURNSTILE_PLAINTEXT" not in names
            assert "TURNSTILE_WORKER_PLAINTEXT" not in names


@pytest.mark.parametrize("name", ["base", "dev", "production"])
def test_the_policy_names_the_certificates_identities_and_matches_the_local_stack(
    built: Built, name: str
) -> None:
    objects = built(name)
    text = config_map(objects, "turnstile-authz-policy")["data"]["authz-policy.toml"]
    assert text == STACK_POLICY.read_text(encoding="utf-8")
    policy = parse_policy(text, known_methods=all_methods())
    sandbox = named(objects, "Certificate", "turnstile-sandbox")["spec"]
    assert sandbox["uris"] == [f"{TD}/sandbox"]
    assert sandbox["usages"] == ["client auth"]
    attach = "turnstile.affinity.v1.AffinityService/Attach"
    allowed = {m for m in all_methods() if policy.decide(f"{TD}/sandbox", m).allowed}
    assert allowed == {attach}
    for service in SERVICES:
        assert not policy.decide(f"{TD}/service/{service}", attach).allowed
    substrate_config = config_map(objects, "turnstile-substrate-config")["data"]
    assert substrate_config["TURNSTILE_K8S_WORKER_TLS_SECRET"] == sandbox["secretName"]


def test_the_ca_chain_issues_every_leaf(built: Built) -> None:
    objects = built("production")
    ca = named(objects, "Certificate", "turnstile-ca")["spec"]
    assert ca["isCA"] is True
    # A ClusterIssuer reads its CA Secret from cert-manager's namespace (SPEC O4).
    issuer = named(objects, "ClusterIssuer", "turnstile-ca-issuer")["spec"]
    assert issuer["ca"]["secretName"] == ca["secretName"]
    for cert in of_kind(objects, "Certificate"):
        if cert["metadata"]["name"] != "turnstile-ca":
            assert cert["spec"]["issuerRef"] == {
                "name": "turnstile-ca-issuer",
                "kind": "ClusterIssuer",
            }
            assert len(cert["spec"]["uris"]) == 1, "an X.509-SVID has one URI SAN"
            if not cert["spec"]["uris"][0].startswith(f"{TD}/service/"):
                # Only services may serve: no other certificate is a server's (SPEC O5).
                assert cert["spec"]["usages"] == ["client auth"]
                assert not cert["spec"].get("dnsNames")


def test_production_carries_no_dev_credentials(built: Built) -> None:
    objects = built("production")
    for secret in of_kind(objects, "Secret"):
        values = [base64.b64decode(v).decode() for v in secret.get("data", {}).values()]
        values += list(secret.get("stringData", {}).values())
        assert not any("dev" in v or "password" in v.lower() for v in values), secret
    settings = config_map(objects, "turnstile-config")["data"]
    redis_url = settings["TURNSTILE_REDIS_URL"]
    assert redis_url.startswith("rediss://")
    userinfo, _, _ = redis_url.removeprefix("rediss://").rpartition("@")
    assert ":" not in userinfo, "no password in the Redis URL"
    assert settings["TURNSTILE_REDIS_PASSWORD_FILE"]
    substrate = config_map(objects, "turnstile-substrate-config")["data"]
    assert substrate["TURNSTILE_DATABASE_SSLMODE"] == "verify-full"
    assert substrate["TURNSTILE_DATABASE_PASSWORD_FILE"]
