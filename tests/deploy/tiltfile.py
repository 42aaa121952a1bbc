"""Evaluate a Tiltfile offline under starlark-pyo3 and record what it declares.

Each Tilt builtin the Tiltfile may call is a Python stub whose parameters are
Tilt's own (names and defaults from Tilt's Go sources: internal/tiltfile/docker.go,
k8s.go, local_resource.go, live_update.go), so a misspelt keyword fails here as it
would in ``tilt up``. Calls are recorded as dataclasses for tests to inspect.
Builtins the stubs do not cover fail evaluation: add a stub when the Tiltfile
starts using one.

``load('ext://restart_process', ...)`` gets a stub of the extension's
``docker_build_with_restart``, which validates like the extension (at least one
live_update step, no ``restart_container()``), passes its other arguments through
the ``docker_build`` stub and, as the extension does, appends the step that
touches the restart file.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import starlark as sl
from yaml import safe_load_all

from .manifests import Obj

Kustomizer = Callable[[Path], str]
"""Renders a kustomization directory to a YAML stream (a stand-in for Tilt's
``kustomize()``, which shells out to kustomize or kubectl)."""


@dataclass(frozen=True)
class Step:
    """A live_update step: sync, run, fall_back_on or restart_container."""

    kind: str
    args: Mapping[str, Any]


@dataclass(frozen=True)
class PortForward:
    local_port: int
    container_port: int
    name: str | None = None
    link_path: str | None = None


@dataclass
class DockerBuild:
    ref: str
    context: Path
    dockerfile: Path | None
    target: str | None
    build_args: dict[str, str]
    only: list[str]
    live_update: list[Step]
    entrypoint: list[str] | str | None
    match_in_env_vars: bool
    restart_file: str | None = None
    """Set when built by the restart_process extension."""


@dataclass
class K8sResource:
    workload: str
    new_name: str
    port_forwards: list[PortForward]
    resource_deps: list[str]
    objects: list[str]
    labels: list[str]

    @property
    def name(self) -> str:
        return self.new_name or self.workload


@dataclass
class LocalResource:
    name: str
    cmd: str | list[str] | None
    dir: Path | None
    deps: list[Path]
    resource_deps: list[str]
    labels: list[str]


@dataclass
class TiltState:
    """Everything a Tiltfile declared."""

    tiltfile_dir: Path
    docker_builds: list[DockerBuild] = field(default_factory=list)
    k8s_resources: list[K8sResource] = field(default_factory=list)
    local_resources: list[LocalResource] = field(default_factory=list)
    k8s_objects: list[Obj] = field(default_factory=list)
    kustomize_dirs: list[Path] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)

    def build(self, ref: str) -> DockerBuild:
        found = [b for b in self.docker_builds if b.ref == ref]
        assert len(found) == 1, f"expected one docker_build of {ref}, found {len(found)}"
        return found[0]

    def resource(self, name: str) -> K8sResource:
        found = [r for r in self.k8s_resources if r.name == name]
        assert len(found) == 1, f"expected one k8s_resource named {name}, found {len(found)}"
        return found[0]

    def resource_names(self) -> set[str]:
        return {r.name for r in self.k8s_resources} | {r.name for r in self.local_resources}


def _str_list(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    assert isinstance(value, list), f"expected a string or list, got {value!r}"
    return [str(v) for v in value]


def _step(value: object) -> Step:
    assert isinstance(value, dict), f"not a step: {value!r}"
    assert "__tilt_step__" in value, f"not a step: {value!r}"
    args = {k: v for k, v in value.items() if k != "__tilt_step__"}
    return Step(kind=str(value["__tilt_step__"]), args=args)


def _port_forward(value: object) -> PortForward:
    if isinstance(value, int):
        return PortForward(value, value)
    if isinstance(value, str):
        local, _, remote = value.rpartition(":")
        return PortForward(int(local or remote), int(remote))
    assert isinstance(value, dict), value
    assert value.get("__tilt_port_forward__"), value
    return PortForward(
        int(value["local_port"]),
        int(value["container_port"] or value["local_port"]),
        value["name"],
        value["link_path"],
    )


class _Recorder:
    """The stubs; each records into ``state`` and returns what Tilt would."""

    def __init__(self, state: TiltState, kustomizer: Kustomizer) -> None:
        self.state = state
        self.kustomizer = kustomizer

    def path(self, value: str) -> Path:
        """Tilt resolves relative paths against the Tiltfile's directory."""
        return (self.state.tiltfile_dir / value).resolve()

    # --- images ---------------------------------------------------------------

    def docker_build(
        self,
        ref: str,
        context: str,
        build_args: dict[str, str] | None = None,
        dockerfile: str | None = None,
        dockerfile_contents: str | None = None,
        cache: object = None,
        live_update: list[object] | None = None,
        match_in_env_vars: bool = False,
        ignore: object = None,
        only: object = None,
        entrypoint: list[str] | str | None = None,
        container_args: list[str] | None = None,
        target: str | None = None,
        ssh: object = None,
        secret: object = None,
        network: str | None = None,
        extra_tag: object = None,
        cache_from: object = None,
        pull: bool = False,
        platform: str | None = None,
    ) -> None:
        self.state.docker_builds.append(
            DockerBuild(
                ref=ref,
                context=self.path(context),
                dockerfile=self.path(dockerfile) if dockerfile else None,
                target=target,
                build_args=dict(build_args or {}),
                only=_str_list(only),
                live_update=[_step(s) for s in live_update or []],
                entrypoint=entrypoint,
                match_in_env_vars=match_in_env_vars,
            )
        )

    def docker_build_with_restart(
        self,
        ref: str,
        context: str,
        entrypoint: list[str] | str,
        live_update: list[object],
        base_suffix: str = "-base",
        restart_file: str = "/.restart-proc",
        **kwargs: object,
    ) -> None:
        steps = [_step(s) for s in live_update]
        if not steps:
            raise ValueError("docker_build_with_restart requires at least one live_update step")
        if any(s.kind == "restart_container" for s in steps):
            raise ValueError("docker_build_with_restart is not compatible with restart_container()")
        inspect.signature(self.docker_build).bind(ref, context, **kwargs)
        self.docker_build(
            ref,
            context,
            entrypoint=entrypoint,
            live_update=[*live_update, self.run(f"date > {restart_file}")],
            **kwargs,  # type: ignore[arg-type]
        )
        self.state.docker_builds[-1].restart_file = restart_file

    # --- live_update steps ----------------------------------------------------

    def sync(self, local_path: str, remote_path: str) -> dict[str, object]:
        return {
            "__tilt_step__": "sync",
            "local_path": str(self.path(local_path)),
            "remote_path": remote_path,
        }

    def run(
        self, cmd: str | list[str], trigger: object = None, echo_off: bool = False
    ) -> dict[str, object]:
        return {"__tilt_step__": "run", "cmd": cmd, "trigger": _str_list(trigger)}

    def fall_back_on(self, files: str | list[str]) -> dict[str, object]:
        return {
            "__tilt_step__": "fall_back_on",
            "files": [str(self.path(f)) for f in _str_list(files)],
        }

    def restart_container(self) -> dict[str, object]:
        return {"__tilt_step__": "restart_container"}

    # --- Kubernetes -----------------------------------------------------------

    def kustomize(
        self,
        pathToDir: str,  # noqa: N803  (Tilt's parameter name)
        kustomize_bin: str | None = None,
        flags: list[str] | None = None,
    ) -> str:
        directory = self.path(pathToDir)
        self.state.kustomize_dirs.append(directory)
        return self.kustomizer(directory)

    def k8s_yaml(self, yaml: object, allow_duplicates: bool = False) -> None:
        for blob in _str_list(yaml):
            if "\n" not in blob and blob.endswith((".yaml", ".yml")):
                blob = self.path(blob).read_text()
            self.state.k8s_objects.extend(d for d in safe_load_all(blob) if d)

    def decode_yaml_stream(self, yaml: str) -> list[object]:
        return [d for d in safe_load_all(yaml) if d]

    def k8s_resource(
        self,
        workload: str = "",
        new_name: str = "",
        port_forwards: object = None,
        extra_pod_selectors: object = None,
        trigger_mode: object = None,
        resource_deps: list[str] | None = None,
        objects: list[str] | None = None,
        auto_init: bool = True,
        pod_readiness: str = "",
        links: object = None,
        labels: object = None,
        discovery_strategy: str = "",
    ) -> None:
        forwards = (
            port_forwards
            if isinstance(port_forwards, list)
            else ([] if port_forwards is None else [port_forwards])
        )
        self.state.k8s_resources.append(
            K8sResource(
                workload=workload,
                new_name=new_name,
                port_forwards=[_port_forward(p) for p in forwards],
                resource_deps=_str_list(resource_deps),
                objects=_str_list(objects),
                labels=_str_list(labels),
            )
        )

    def port_forward(
        self,
        local_port: int,
        container_port: int | None = None,
        name: str | None = None,
        link_path: str | None = None,
        host: str | None = None,
    ) -> dict[str, object]:
        return {
            "__tilt_port_forward__": True,
            "local_port": local_port,
            "container_port": container_port,
            "name": name,
            "link_path": link_path,
        }

    def link(self, url: str, name: str | None = None) -> dict[str, object]:
        return {"__tilt_link__": True, "url": url, "name": name}

    # --- local ----------------------------------------------------------------

    def local_resource(
        self,
        name: str,
        cmd: str | list[str] | None = None,
        deps: object = None,
        trigger_mode: object = None,
        resource_deps: list[str] | None = None,
        ignore: object = None,
        auto_init: bool = True,
        serve_cmd: object = None,
        cmd_bat: object = None,
        serve_cmd_bat: object = None,
        allow_parallel: bool = False,
        links: object = None,
        labels: object = None,
        env: dict[str, str] | None = None,
        serve_env: dict[str, str] | None = None,
        readiness_probe: object = None,
        dir: str | None = None,
        serve_dir: str | None = None,
    ) -> None:
        if cmd is None and serve_cmd is None:
            raise ValueError("local_resource must have a cmd and/or a serve_cmd")
        self.state.local_resources.append(
            LocalResource(
                name=name,
                cmd=cmd,
                dir=self.path(dir) if dir else None,
                deps=[self.path(d) for d in _str_list(deps)],
                resource_deps=_str_list(resource_deps),
                labels=_str_list(labels),
            )
        )

    # --- settings (recorded nowhere; accepted with Tilt's parameters) ---------

    def update_settings(
        self,
        max_parallel_updates: int | None = None,
        k8s_upsert_timeout_secs: int | None = None,
        suppress_unused_image_warnings: object = None,
    ) -> None:
        return None

    def allow_k8s_contexts(self, contexts: object) -> None:
        return None

    def builtins(self) -> dict[str, Callable[..., object]]:
        return {
            name: getattr(self, name)
            for name in (
                "docker_build",
                "sync",
                "run",
                "fall_back_on",
                "restart_container",
                "kustomize",
                "k8s_yaml",
                "decode_yaml_stream",
                "k8s_resource",
                "port_forward",
                "link",
                "local_resource",
                "update_settings",
                "allow_k8s_contexts",
            )
        }

    def extensions(self) -> dict[str, dict[str, Callable[..., object]]]:
        return {
            "ext://restart_process": {"docker_build_with_restart": self.docker_build_with_restart}
        }


def evaluate(tiltfile: Path, kustomizer: Kustomizer) -> TiltState:
    """Evaluate ``tiltfile`` with recording stubs; raise ``starlark.StarlarkError``
    (with Tilt-like messages) when it calls something wrongly."""
    state = TiltState(tiltfile_dir=tiltfile.parent.resolve())
    recorder = _Recorder(state, kustomizer)

    dialect = sl.Dialect.extended()
    dialect.enable_top_level_stmt = True
    ast = sl.parse(str(tiltfile), tiltfile.read_text(), dialect)

    module = sl.Module()
    for name, stub in recorder.builtins().items():
        module.add_callable(name, stub)

    extensions = recorder.extensions()

    def load(module_id: str) -> sl.FrozenModule:
        if module_id not in extensions:
            raise ValueError(f"no stub for load({module_id!r})")
        state.loads.append(module_id)
        ext = sl.Module()
        for name, stub in extensions[module_id].items():
            ext.add_callable(name, stub)
        return ext.freeze()

    globals_ = sl.Globals.extended_by(
        [sl.LibraryExtension.StructType, sl.LibraryExtension.Print, sl.LibraryExtension.Json]
    )
    sl.eval(module, ast, globals_, sl.FileLoader(load))
    return state


def fragments(obj: Obj) -> set[str]:
    """The strings Tilt's ``objects=`` accepts for an object: name, name:kind,
    name:kind:namespace (lower-case; Tilt matches them case-insensitively)."""
    meta = obj["metadata"]
    name, kind = meta["name"].lower(), obj["kind"].lower()
    namespace = meta.get("namespace", "default").lower()
    return {name, f"{name}:{kind}", f"{name}:{kind}:{namespace}"}
