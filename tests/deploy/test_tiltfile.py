"""tilt/Tiltfile, evaluated offline with recording stubs of Tilt's builtins.

What this proves: the file parses and runs under Starlark with Tilt's parameter
names; it builds the images the dev overlay uses from paths that exist; its
live_update steps, port forwards, resource dependencies and object groupings are
the ones below, and Tilt's own load-time checks (unknown workload, non-unique
object fragment, unused image) would pass. What it does not prove: that images
build, that the cluster accepts the objects, or that live_update works at run time.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import starlark as sl

from .conftest import TILTFILE
from .manifests import OVERLAYS, PORTS, REPO_ROOT, SERVICES, Obj, containers, workloads
from .tiltfile import DockerBuild, TiltState, evaluate, fragments

DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "service.Dockerfile"
IMAGES = {f"turnstile-{s}" for s in SERVICES} | {"turnstile-worker", "turnstile-migrate"}
STACK = ("redis", "postgres", "jaeger")


def _service_build(tilt: TiltState, service: str) -> DockerBuild:
    return tilt.build(f"turnstile-{service}")


def _dockerfile_stages() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE.read_text(), re.M | re.I))


def _dockerfile_copy_sources(service: str) -> set[str]:
    """Sources of the Dockerfile's COPY lines that read the build context."""
    sources: set[str] = set()
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY") and "--from" not in line:
            *srcs, _dest = line.split()[1:]
            sources.update(s.replace("${SERVICE}", service).rstrip("/") for s in srcs)
    return sources


def _image_name(ref: str) -> str:
    """An image reference without tag or digest."""
    name = ref.split("@")[0]
    return name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name


def test_tiltfile_loads_the_restart_process_extension(tilt: TiltState) -> None:
    assert tilt.loads == ["ext://restart_process"]


def test_tiltfile_applies_the_dev_overlay(tilt: TiltState) -> None:
    assert tilt.kustomize_dirs == [OVERLAYS["dev"].resolve()]


def test_tiltfile_builds_each_service_the_worker_and_the_migration(tilt: TiltState) -> None:
    assert {b.ref for b in tilt.docker_builds} == IMAGES
    stages = _dockerfile_stages()
    for build in tilt.docker_builds:
        assert build.context == REPO_ROOT
        assert build.dockerfile == DOCKERFILE
        assert build.target in stages, f"{build.ref}: no stage {build.target!r}"
        member = REPO_ROOT / "services" / build.build_args["SERVICE"]
        assert (member / "pyproject.toml").is_file(), f"{build.ref}: no member {member}"
    assert tilt.build("turnstile-worker").build_args == {
        "SERVICE": "affinity",
        "COMMAND": "turnstile-worker",
    }
    assert tilt.build("turnstile-migrate").build_args == {
        "SERVICE": "substrate",
        "COMMAND": "turnstile-migrate",
    }


@pytest.mark.parametrize("service", SERVICES)
def test_service_live_update_syncs_sources_then_restarts_the_process(
    tilt: TiltState, service: str
) -> None:
    build = _service_build(tilt, service)
    assert build.target == "dev", "live_update needs the image whose /app the user owns"
    assert build.entrypoint == [f"turnstile-{service}"]
    assert build.restart_file is not None
    assert build.restart_file.startswith("/app/")

    kinds = [step.kind for step in build.live_update]
    # Tilt's order: fall_back_on first, then syncs, then runs.
    assert kinds == sorted(kinds, key=["fall_back_on", "sync", "run"].index), kinds
    assert "restart_container" not in kinds

    fallbacks = {
        Path(f) for s in build.live_update if s.kind == "fall_back_on" for f in s.args["files"]
    }
    assert {REPO_ROOT / "pyproject.toml", REPO_ROOT / "uv.lock"} <= fallbacks

    synced = {
        Path(s.args["local_path"]).relative_to(REPO_ROOT).as_posix(): s.args["remote_path"]
        for s in build.live_update
        if s.kind == "sync"
    }
    expected = {f"libs/{lib}/src" for lib in ("contracts", "platform", "clientkeys")}
    assert set(synced) == expected | {f"services/{service}/src"}
    for local, remote in synced.items():
        assert (REPO_ROOT / local).is_dir(), f"sync source {local} does not exist"
        assert remote == f"/app/{local}", "the image installs members editable from /app"

    last = build.live_update[-1]
    assert last.kind == "run"
    assert last.args["cmd"] == f"date > {build.restart_file}"


@pytest.mark.parametrize("ref", sorted(IMAGES))
def test_build_context_is_limited_to_what_the_dockerfile_copies(tilt: TiltState, ref: str) -> None:
    build = tilt.build(ref)
    only = set(build.only)
    for path in only:
        assert "*" not in path, "Tilt's only= takes paths, not globs"
        assert (build.context / path).exists(), f"{ref}: only= path {path} does not exist"
    copied = _dockerfile_copy_sources(build.build_args["SERVICE"])
    missing = {src for src in copied if not any(src == o or src.startswith(o + "/") for o in only)}
    assert not missing, f"{ref}: the Dockerfile copies {missing} but only= leaves them out"
    for step in build.live_update:
        if step.kind == "sync":
            local = Path(step.args["local_path"]).relative_to(build.context).as_posix()
            assert any(local == o or local.startswith(o + "/") for o in only)


def test_worker_image_reaches_sandbox_pods_through_substrate_env(
    tilt: TiltState, tilt_objects: list[Obj]
) -> None:
    worker = tilt.build("turnstile-worker")
    assert worker.match_in_env_vars
    assert worker.live_update == [], "Tilt does not manage sandbox pods: nothing to live-update"
    substrate = next(
        w for w, _ in workloads(tilt_objects) if w["metadata"]["name"] == "turnstile-substrate"
    )
    env = {
        e["name"]: e.get("value")
        for c in containers(substrate["spec"]["template"])
        for e in c.get("env", [])
    }
    assert env["TURNSTILE_K8S_IMAGE"] == "turnstile-worker"


def test_every_built_image_is_deployed_and_every_turnstile_image_is_built(
    tilt: TiltState, tilt_objects: list[Obj]
) -> None:
    used: set[str] = set()
    in_env: set[str] = set()
    for _, template in workloads(tilt_objects):
        for container in containers(template):
            used.add(_image_name(container["image"]))
            in_env.update(e["value"] for e in container.get("env", []) if "value" in e)
    built = {b.ref for b in tilt.docker_builds}
    deployed = {
        b.ref
        for b in tilt.docker_builds
        if b.ref in used or (b.match_in_env_vars and b.ref in in_env)
    }
    assert deployed == built, f"built but unused (Tilt would warn): {built - deployed}"
    ours = {image for image in used if image.startswith("turnstile-")}
    assert ours <= built, f"deployed but never built: {ours - built}"


def test_restart_wrapped_images_run_only_their_entrypoint(
    tilt: TiltState, tilt_objects: list[Obj]
) -> None:
    """The restart wrapper replaces the command of every container using the image,
    so an image wrapped for a server must not also back a Job with another command."""
    for build in (b for b in tilt.docker_builds if b.restart_file):
        for workload, template in workloads(tilt_objects):
            for container in containers(template):
                if _image_name(container["image"]) == build.ref:
                    assert container.get("command") == build.entrypoint, (
                        f"{workload['kind']}/{workload['metadata']['name']} runs "
                        f"{container.get('command')} from {build.ref}, whose command Tilt "
                        f"replaces with {build.entrypoint}"
                    )


def test_port_forwards_expose_grpc_metrics_stores_and_the_jaeger_ui(tilt: TiltState) -> None:
    def forwards(name: str) -> set[tuple[int, int]]:
        return {(p.local_port, p.container_port) for p in tilt.resource(name).port_forwards}

    assert (16686, 16686) in forwards("jaeger")
    for service, (grpc_port, metrics_port) in PORTS.items():
        assert forwards(service) == {(grpc_port, grpc_port), (metrics_port, metrics_port)}
    assert {c for _, c in forwards("redis")} == {6379}
    assert {c for _, c in forwards("postgres")} == {5432}
    local_ports = [p.local_port for r in tilt.k8s_resources for p in r.port_forwards]
    assert len(local_ports) == len(set(local_ports)), "a local port is forwarded twice"


def test_services_start_after_redis_postgres_and_the_migration(tilt: TiltState) -> None:
    for service in SERVICES:
        deps = set(tilt.resource(service).resource_deps)
        assert {"redis", "postgres", "migrate", "namespace"} <= deps, (service, deps)
    assert {"postgres", "namespace"} <= set(tilt.resource("migrate").resource_deps)
    for store in STACK:
        assert "namespace" in tilt.resource(store).resource_deps


def test_resource_deps_name_declared_resources_without_cycles(tilt: TiltState) -> None:
    names = tilt.resource_names()
    graph = {r.name: set(r.resource_deps) for r in tilt.k8s_resources}
    graph.update({r.name: set(r.resource_deps) for r in tilt.local_resources})
    for name, deps in graph.items():
        assert deps <= names, f"{name} depends on undeclared {deps - names}"

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {' -> '.join((*path, name))}"
        for dep in graph[name]:
            visit(dep, (*path, name))

    for name in graph:
        visit(name, ())


def test_contracts_are_regenerated_when_proto_changes(tilt: TiltState) -> None:
    (contracts,) = [r for r in tilt.local_resources if r.name == "contracts"]
    assert contracts.cmd == "./scripts/gen-contracts"
    assert contracts.dir == REPO_ROOT
    assert contracts.deps == [REPO_ROOT / "proto"]
    script = REPO_ROOT / "scripts" / "gen-contracts"
    assert script.is_file()
    assert os.access(script, os.X_OK)
    for service in SERVICES:
        assert "contracts" in tilt.resource(service).resource_deps


def test_k8s_resources_group_every_object_as_tilt_would(
    tilt: TiltState, tilt_objects: list[Obj]
) -> None:
    """Replays Tilt's assembly: a resource per workload (with the Services selecting
    its pods), then each objects= fragment must match exactly one object not yet
    taken. Nothing may be left for "uncategorized"."""
    remaining = list(tilt_objects)
    by_workload: dict[str, list[Obj]] = {}
    for workload, template in workloads(tilt_objects):
        name = workload["metadata"]["name"]
        assert name not in by_workload, f"two workloads named {name}"
        labels = template["metadata"].get("labels", {})
        grouped = [workload] + [
            o
            for o in remaining
            if o["kind"] == "Service"
            and all(labels.get(k) == v for k, v in o["spec"].get("selector", {}).items())
        ]
        by_workload[name] = grouped
        remaining = [o for o in remaining if not any(o is g for g in grouped)]

    for resource in tilt.k8s_resources:
        if resource.workload:
            assert resource.workload in by_workload, f"no workload {resource.workload}"
        else:
            assert resource.new_name, "a group without a workload needs new_name"
            assert resource.objects, "a group without a workload needs objects"
        for fragment in resource.objects:
            matching = [o for o in tilt_objects if fragment.lower() in fragments(o)]
            assert len(matching) == 1, f"{fragment!r} matches {len(matching)} objects"
            assert any(o is matching[0] for o in remaining), f"{fragment!r} already taken"
            remaining = [o for o in remaining if o is not matching[0]]

    leftover = [f"{o['kind']}/{o['metadata']['name']}" for o in remaining]
    assert not leftover, f"uncategorized: {leftover}"
    named = {r.workload for r in tilt.k8s_resources if r.workload}
    assert named == set(by_workload), f"workloads without k8s_resource: {set(by_workload) - named}"


def test_stubs_reject_what_tilt_would_reject(tmp_path: Path) -> None:
    """The harness has teeth: a misspelt keyword fails evaluation as in Tilt."""
    bad = tmp_path / "Tiltfile"
    bad.write_text("k8s_resource('x', resource_dep=['y'])\n")
    with pytest.raises(sl.StarlarkError, match="resource_dep"):
        evaluate(bad, lambda _: "")
    assert TILTFILE.is_file()
