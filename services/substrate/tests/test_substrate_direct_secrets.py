"""Direct runtimes hold no secrets (SPEC O4): real substrate and runtime processes.

A substrate process is started with secrets in its environment (``PGPASSWORD``,
``AWS_SECRET_ACCESS_KEY``, a database URL with a password) and key files beside
it (the credential signing key, its TLS key, the local CA key, the database
password file), laid out as the local stack lays them out. Its runtimes play
the untrusted code: each reports its environment and tries to read
``/proc/<substrate>/environ``, every key file, and another runtime's credential.
They find nothing secret: the environment is an allowlist, and (the substrate
running as root) each runtime runs as a uid of its own.

The tests that need another uid run only as root (the suite does, here) and skip
otherwise; the allowlist is tested as any user.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from turnstile_platform.pki import ensure_local_pki
from turnstile_platform.sandbox_credentials import (
    CredentialIssuer,
    SigningKey,
    generate_key_pair,
)
from turnstile_substrate.direct import processes
from turnstile_substrate.direct.environment import (
    BASE_ALLOWLIST,
    parse_names,
    runtime_environment,
)
from turnstile_substrate.direct.runtime_users import Identity, RuntimeUsers, parse_range
from turnstile_substrate.direct.substrate import DirectSubstrate
from turnstile_substrate.runtime import RuntimeSpec
from turnstile_substrate.settings import SubstrateSettings

AS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0, reason="runtimes run as another uid only under a root substrate"
)

DRIVER = Path(__file__).with_name("direct_substrate_process.py")
UIDS = "2700000-2700099"
PRYING = "turnstile_testing.prying_runtime:main"

#: What the substrate's environment holds and no runtime may see.
DB_PASSWORD = "db-pass-5e3c9a"
SECRETS = {
    "PGPASSWORD": "pg-pass-7f21b0",
    "AWS_ACCESS_KEY_ID": "AKIA-key-id-4411",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-9d8e7f",
    "TURNSTILE_DATABASE_URL": f"postgresql://turnstile:{DB_PASSWORD}@127.0.0.1:5432/turnstile",
    "TURNSTILE_REDIS_PASSWORD": "redis-pass-0b0b",
}

#: What a shell adds to its own environment (the shell runtime reports through ``env``).
SHELL_ADDS = {"PWD", "SHLVL", "_", "OLDPWD"}

#: The runtime in the shell: the same report as :mod:`turnstile_testing.prying_runtime`.
SHELL_PRY = r"""
if [ -n "$PRY_ESCAPE" ]; then
  # A child that leaves the runtime's session and process group (it writes its
  # pid once it has), as untrusted code may.
  setsid /bin/bash -c 'echo $$ > "$HOME/escaped"; exec sleep infinity' >/dev/null 2>&1 &
  until [ -s "$HOME/escaped" ]; do sleep 0.01; done
fi
exec 3<>/dev/tcp/127.0.0.1/$PRY_PORT
{
  [ -n "$PRY_ESCAPE" ] && printf 'escaped %s\n' "$(cat "$HOME/escaped")"
  printf 'uid %s %s\n' "$(id -ru)" "$(id -u)"
  printf 'ppid %s\n' "$PPID"
  printf 'env %s\n' "$(env -0 | base64 -w0)"
  IFS=: read -ra targets <<< "$PRY_TARGETS"
  for target in "${targets[@]}"; do
    if content=$(base64 -w0 < "$target" 2>/dev/null); then
      printf 'read %s %s\n' "$target" "$content"
    else
      printf 'denied %s\n' "$target"
    fi
  done
  echo end
} >&3
exec 3>&-
exec sleep infinity
"""
SHELL_COMMAND = f"/bin/bash -c {shlex.quote(SHELL_PRY)}"


@dataclass
class Report:
    """What one runtime saw."""

    uid: int = -1
    euid: int = -1
    ppid: int = -1
    escaped: int = -1
    env: dict[str, str] = field(default_factory=dict)
    read: dict[str, bytes] = field(default_factory=dict)
    denied: set[str] = field(default_factory=set)
    raw: bytes = b""

    @classmethod
    def parse(cls, data: bytes) -> Report:
        report = cls(raw=data)
        for line in data.decode().splitlines():
            word, _, rest = line.partition(" ")
            if word == "uid":
                report.uid, report.euid = map(int, rest.split())
            elif word == "ppid":
                report.ppid = int(rest)
            elif word == "escaped":
                report.escaped = int(rest)
            elif word == "env":
                pairs = base64.b64decode(rest).decode().split("\0")
                report.env = dict(pair.partition("=")[::2] for pair in pairs if pair)
            elif word == "read":
                path, _, content = rest.partition(" ")
                report.read[path] = base64.b64decode(content)
            elif word == "denied":
                report.denied.add(rest)
        assert data.decode().splitlines()[-1] == "end", data
        return report

    @property
    def everything(self) -> bytes:
        """All it saw, decoded: its environment and every file it could read."""
        env = "\0".join(f"{name}={value}" for name, value in self.env.items()).encode()
        return b"\n".join([env, *self.read.values()])


class Reports:
    """A socket runtimes report to: the test awaits reports instead of sleeping."""

    def __init__(self) -> None:
        self.reports: asyncio.Queue[Report] = asyncio.Queue()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Reports:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self.reports.put(Report.parse(await reader.read()))
            writer.close()

        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def next(self) -> Report:
        async with asyncio.timeout(30):
            return await self.reports.get()


@dataclass
class Host:
    """A substrate's files as the local stack lays them out, in a directory anyone
    may traverse (so only each file's own mode protects it)."""

    root: Path
    signing_key: Path
    tls_dir: Path
    password_file: Path

    @property
    def state_dir(self) -> Path:
        return self.root / "direct"

    @property
    def key_files(self) -> dict[str, Path]:
        return {
            "signing key": self.signing_key,
            "substrate TLS key": self.tls_dir / "substrate.key",
            "CA key": self.tls_dir / "ca.key",
            "database password": self.password_file,
        }

    def credential(self, sandbox_id: str) -> Path:
        return self.state_dir / sandbox_id / "credential"

    def secret_values(self) -> list[bytes]:
        values = [value.encode() for value in SECRETS.values()] + [DB_PASSWORD.encode()]
        return values + [path.read_bytes() for path in self.key_files.values()]

    def environment(self, port: int, **settings: str) -> dict[str, str]:
        """The substrate process's environment: the secrets, and its settings."""
        return {
            **{name: value for name, value in os.environ.items() if name in BASE_ALLOWLIST},
            **SECRETS,
            "TURNSTILE_PLAINTEXT": "false",
            "TURNSTILE_TLS_CERT_FILE": str(self.tls_dir / "substrate.crt"),
            "TURNSTILE_TLS_KEY_FILE": str(self.tls_dir / "substrate.key"),
            "TURNSTILE_TLS_CA_FILE": str(self.tls_dir / "ca.crt"),
            "TURNSTILE_DIRECT_WORKER_TLS_CERT_FILE": str(self.tls_dir / "worker.crt"),
            "TURNSTILE_DIRECT_WORKER_TLS_KEY_FILE": str(self.tls_dir / "worker.key"),
            "TURNSTILE_DATABASE_PASSWORD_FILE": str(self.password_file),
            "TURNSTILE_WORKER_CREDENTIAL_SIGNING_KEY_FILE": str(self.signing_key),
            "TURNSTILE_DIRECT_STATE_DIR": str(self.state_dir),
            "TURNSTILE_AFFINITY_ADDR": "127.0.0.1:50999",
            "TURNSTILE_DIRECT_RUNTIME_UIDS": UIDS,
            "TURNSTILE_DIRECT_RUNTIME_COMMAND": SHELL_COMMAND,
            "TURNSTILE_DIRECT_RUNTIME_ENV_ALLOW": "PRY_PORT,PRY_TARGETS,PRY_ESCAPE",
            "PRY_PORT": str(port),
            "PRY_TARGETS": ":".join(
                [*map(str, self.key_files.values()), "/proc/self/environ"]
                + [str(self.credential(sandbox_id)) for sandbox_id in ("sb-1", "sb-2")]
                + [str(self.state_dir / "worker-tls" / "tls.key")]
            ),
            **settings,
        }


@pytest.fixture
def host() -> Iterator[Host]:
    root = Path(tempfile.mkdtemp(prefix="turnstile-o4-", dir="/tmp"))
    os.chmod(root, 0o711)  # noqa: S103 - traversable, as a state directory's parents must be
    tls_dir = root / "tls"
    holders = {"substrate": "service/substrate", "worker": "sandbox"}
    ensure_local_pki(tls_dir, "turnstile.local", holders)
    # Harder than the stack's 0700: the files' own modes alone protect them.
    os.chmod(tls_dir, 0o711)  # noqa: S103
    keys = root / "sandbox-credentials"
    generate_key_pair(keys / "signing-key.pem", keys / "public-keys.pem")
    os.chmod(keys, 0o711)  # noqa: S103
    password_file = root / "database-password"
    password_file.write_text(DB_PASSWORD)
    os.chmod(password_file, 0o600)
    try:
        yield Host(root, keys / "signing-key.pem", tls_dir, password_file)
    finally:
        for uid in processes.live_uids(parse_range(UIDS)):
            processes.kill_user(uid)
        shutil.rmtree(root, ignore_errors=True)


class SubstrateProcess:
    """The driver process: a Direct substrate with the host's environment."""

    def __init__(self, env: dict[str, str], redis_url: str, redis_prefix: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(DRIVER)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.redis_url, self.redis_prefix = redis_url, redis_prefix

    async def start(self, *sandbox_ids: str) -> None:
        assert self.process.stdin is not None
        config = {"redis_url": self.redis_url, "redis_prefix": self.redis_prefix}
        self.process.stdin.write(json.dumps({**config, "sandboxes": list(sandbox_ids)}) + "\n")
        self.process.stdin.flush()
        for sandbox_id in sandbox_ids:
            assert await self._line() == {"started": sandbox_id}

    async def stop(self) -> list[str]:
        assert self.process.stdin is not None
        self.process.stdin.write("stop\n")
        self.process.stdin.flush()
        stopped = (await self._line())["stopped"]
        assert isinstance(stopped, list)
        await asyncio.to_thread(self.process.wait, 30)
        return stopped

    async def _line(self) -> dict[str, object]:
        assert self.process.stdout is not None
        async with asyncio.timeout(30):
            line = await asyncio.to_thread(self.process.stdout.readline)
        assert line, f"the substrate process exited with {self.process.wait()}"
        parsed: dict[str, object] = json.loads(line)
        return parsed

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
async def reports() -> AsyncIterator[Reports]:
    async with Reports() as reports:
        yield reports


@pytest.fixture
def substrate_process(
    host: Host, reports: Reports, redis_url: str, redis_prefix: str
) -> Iterator[Callable[..., SubstrateProcess]]:
    """``substrate_process(**settings)``: a driver process with the host's environment."""
    started: list[SubstrateProcess] = []

    def make(**settings: str) -> SubstrateProcess:
        process = SubstrateProcess(
            host.environment(reports.port, **settings), redis_url, redis_prefix
        )
        started.append(process)
        return process

    yield make
    for process in started:
        process.kill()


def workspace_of(host: Host, sandbox_id: str) -> str:
    return str(host.state_dir / sandbox_id / "workspace")


def allowed_name(name: str) -> bool:
    return (
        name in BASE_ALLOWLIST
        or name.startswith("LC_")
        or name
        in {
            "HOME",
            "PRY_PORT",
            "PRY_TARGETS",
            "TURNSTILE_AFFINITY_ADDR",
            "TURNSTILE_AFFINITY_SPIFFE_ID",  # whom the worker expects to dial (SPEC O5)
        }
        or name.startswith("TURNSTILE_WORKER_")
        or name in SHELL_ADDS
    )


def assert_holds_no_secret(host: Host, report: Report, driver_pid: int, sandbox_id: str) -> None:
    # Its own uid of the range, never root, never the substrate's.
    assert report.uid == report.euid
    assert report.uid in parse_range(UIDS)
    # Its environment: the allowlist and its worker settings, nothing else.
    assert all(allowed_name(name) for name in report.env), sorted(report.env)
    assert not set(SECRETS) & set(report.env)
    assert report.env["HOME"] == workspace_of(host, sandbox_id)
    assert report.env["TURNSTILE_WORKER_SANDBOX_ID"] == sandbox_id
    # The substrate's environment and key files: unreadable.
    assert f"/proc/{driver_pid}/environ" in report.denied
    for path in host.key_files.values():
        assert str(path) in report.denied, path
    # Its own credential and the sandbox-class TLS key it attaches with: readable.
    assert str(host.credential(sandbox_id)) in report.read
    assert str(host.state_dir / "worker-tls" / "tls.key") in report.read
    assert report.env["TURNSTILE_WORKER_TLS_KEY_FILE"] == str(
        host.state_dir / "worker-tls" / "tls.key"
    )
    # No secret anywhere in what it saw (its own /proc/self/environ included).
    for secret in host.secret_values():
        assert secret not in report.everything


@AS_ROOT
async def test_a_runtime_started_from_its_command_finds_no_secret(
    host: Host, reports: Reports, substrate_process: Callable[..., SubstrateProcess]
) -> None:
    substrate: SubstrateProcess = substrate_process(TURNSTILE_DIRECT_RUNTIME_PRELOAD="")
    await substrate.start("sb-1", "sb-2")
    first, second = sorted([await reports.next(), await reports.next()], key=lambda r: r.uid)
    driver = substrate.process.pid
    # The control: the secrets really are in the substrate's /proc environ.
    environ = await asyncio.to_thread(Path(f"/proc/{driver}/environ").read_bytes)
    assert SECRETS["PGPASSWORD"].encode() in environ
    by_sandbox = {r.env["TURNSTILE_WORKER_SANDBOX_ID"]: r for r in (first, second)}
    for sandbox_id, report in by_sandbox.items():
        assert report.ppid == driver  # exec'd by the substrate itself
        assert_holds_no_secret(host, report, driver, sandbox_id)
    # A uid each, so neither reads the other's credential.
    assert first.uid != second.uid
    assert str(host.credential("sb-2")) in by_sandbox["sb-1"].denied
    assert str(host.credential("sb-1")) in by_sandbox["sb-2"].denied
    assert sorted(await substrate.stop()) == ["sb-1", "sb-2"]


@AS_ROOT
async def test_a_runtime_forked_by_the_preloaded_launcher_finds_no_secret(
    host: Host, reports: Reports, substrate_process: Callable[..., SubstrateProcess]
) -> None:
    substrate: SubstrateProcess = substrate_process(TURNSTILE_DIRECT_RUNTIME_PRELOAD=PRYING)
    await substrate.start("sb-1", "sb-2")
    reported = [await reports.next(), await reports.next()]
    driver = substrate.process.pid
    by_sandbox = {r.env["TURNSTILE_WORKER_SANDBOX_ID"]: r for r in reported}
    launchers = {r.ppid for r in reported}
    assert len(launchers) == 1  # forked by the launcher
    assert driver not in launchers
    # The launcher itself (which every forked runtime's /proc/self/environ shows)
    # started with the allowlist, not the substrate's environment.
    launcher = launchers.pop()
    launcher_environ = await asyncio.to_thread(Path(f"/proc/{launcher}/environ").read_bytes)
    # Its argv, which anyone on the host may read, names no secret either.
    launcher_argv = await asyncio.to_thread(Path(f"/proc/{launcher}/cmdline").read_bytes)
    for secret in SECRETS.values():
        assert secret.encode() not in launcher_environ
        assert secret.encode() not in launcher_argv
    for sandbox_id, report in by_sandbox.items():
        assert_holds_no_secret(host, report, driver, sandbox_id)
        assert str(host.credential("sb-2" if sandbox_id == "sb-1" else "sb-1")) in report.denied
    assert by_sandbox["sb-1"].uid != by_sandbox["sb-2"].uid
    assert sorted(await substrate.stop()) == ["sb-1", "sb-2"]


@AS_ROOT
async def test_each_runtime_owns_its_workspace_and_credential_and_nothing_else(
    host: Host, reports: Reports, substrate_process: Callable[..., SubstrateProcess]
) -> None:
    substrate: SubstrateProcess = substrate_process(TURNSTILE_DIRECT_RUNTIME_PRELOAD="")
    await substrate.start("sb-1")
    report = await reports.next()

    def mode(path: Path) -> tuple[int, int, int]:
        info = path.stat()
        return stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid

    sandbox = host.state_dir / "sb-1"
    uid, group = report.uid, parse_range(UIDS).start
    assert mode(host.state_dir) == (0o711, 0, 0)
    assert mode(sandbox) == (0o711, 0, 0)
    assert mode(sandbox / "workspace") == (0o700, uid, group)
    assert mode(sandbox / "credential") == (0o600, uid, group)
    assert mode(sandbox / "runtime.json") == (0o600, 0, 0)
    assert mode(sandbox / "runtime.log") == (0o600, 0, 0)
    assert mode(host.state_dir / "worker-tls") == (0o750, 0, group)
    assert mode(host.state_dir / "worker-tls" / "tls.key") == (0o640, 0, group)
    # The substrate's own keys stay as they were: 0600, root's.
    for path in host.key_files.values():
        assert mode(path)[:2] == (0o600, 0), path
    assert json.loads((sandbox / "runtime.json").read_text())["uid"] == uid
    await substrate.stop()


@AS_ROOT
async def test_stopping_a_runtime_kills_what_escaped_its_process_group(
    host: Host, reports: Reports, substrate_process: Callable[..., SubstrateProcess]
) -> None:
    substrate: SubstrateProcess = substrate_process(
        TURNSTILE_DIRECT_RUNTIME_PRELOAD="", PRY_ESCAPE="1"
    )
    await substrate.start("sb-1")
    report = await reports.next()
    record = json.loads((host.state_dir / "sb-1" / "runtime.json").read_text())
    escaped_ticks = processes.start_ticks(report.escaped)
    assert escaped_ticks is not None  # it runs, as the runtime's uid, outside its group
    assert os.getsid(report.escaped) == os.getpgid(report.escaped) != record["pid"]
    assert os.getsid(record["pid"]) == record["pid"]
    assert await substrate.stop() == ["sb-1"]
    assert not processes.is_alive(report.escaped, escaped_ticks)
    assert report.uid not in processes.live_uids()
    assert report.uid not in processes.live_uids(parse_range(UIDS))


@AS_ROOT
async def test_a_renewed_credential_stays_its_runtimes_alone_and_a_restore_keeps_its_uid(
    host: Host, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """In-process: renewal rewrites the file as the runtime's uid's, 0600; a restored
    sandbox gets its workspace's uid back when that uid is free, and another uid (its
    workspace given to it) when not."""
    signing = SigningKey.from_file(host.signing_key)
    issuer = CredentialIssuer(signing, redis, redis_prefix, ttl_s=3600)
    substrate = DirectSubstrate(
        SubstrateSettings(
            direct_state_dir=host.state_dir,
            direct_runtime_command="/bin/sleep infinity",
            direct_runtime_uids=UIDS,
            affinity_addr="127.0.0.1:50999",
            plaintext=True,
        ),
        issuer,
    )
    await substrate.start()
    path = host.credential("sb-1")

    def record_uid(sandbox_id: str) -> int:
        record = json.loads((host.state_dir / sandbox_id / "runtime.json").read_text())
        uid: int = record["uid"]
        return uid

    try:
        spec = RuntimeSpec(sandbox_id="sb-1", tier="", client_label="acme")
        await substrate.ensure_runtime(spec, substrate.plan(spec), no_gate)
        uid = record_uid("sb-1")
        before = path.read_text()
        aged = time.time() - 1900  # past half of the 3600 s ttl
        os.utime(path, (aged, aged))
        assert await substrate.renew_credentials(issuer) == 1
        assert path.read_text() != before
        info = path.stat()
        assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o600, uid)

        # Its workspace keeps a file of its own; another sandbox takes its uid meanwhile.
        kept = host.state_dir / "sb-1" / "workspace" / "notes.txt"
        kept.write_text("kept")
        os.chown(kept, uid, parse_range(UIDS).start)
        assert await substrate.stop_runtime("sb-1")
        other = RuntimeSpec(sandbox_id="sb-2", tier="", client_label="acme")
        await substrate.ensure_runtime(other, substrate.plan(other), no_gate)
        assert record_uid("sb-2") == uid  # free again once sb-1's processes were gone
        # Restored while its uid is held: another uid, and the workspace is given to it.
        restore = RuntimeSpec(sandbox_id="sb-1", tier="", client_label="acme", restore=True)
        await substrate.ensure_runtime(restore, substrate.plan(restore), no_gate)
        moved = record_uid("sb-1")
        assert moved != uid
        assert kept.stat().st_uid == kept.parent.stat().st_uid == moved
        # Restored while its own uid is free: it gets that one back, not the first free.
        assert await substrate.stop_runtime("sb-1")
        assert await substrate.stop_runtime("sb-2")
        await substrate.ensure_runtime(restore, substrate.plan(restore), no_gate)
        assert record_uid("sb-1") == moved
    finally:
        for sandbox_id in ("sb-1", "sb-2"):
            await substrate.stop_runtime(sandbox_id)
        await substrate.close()


def read_as(uid: int, path: Path) -> subprocess.CompletedProcess[bytes]:
    """``cat path`` as a process of ``uid`` in the runtimes' group, as a runtime runs."""
    return subprocess.run(
        ["/bin/cat", str(path)],
        user=uid,
        group=parse_range(UIDS).start,
        extra_groups=[],
        capture_output=True,
        check=False,
    )


@AS_ROOT
async def test_the_next_runtime_of_a_stopped_sandboxs_uid_cannot_reach_its_workspace(
    host: Host, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """A stopped sandbox's workspace keeps its last uid's ownership, and that uid goes
    to the next runtime (another tenant's sandbox): its directory is closed (0700)
    before the uid is free, and opened again only once a restore has given the
    workspace to its new runtime's uid."""
    substrate = DirectSubstrate(
        SubstrateSettings(
            direct_state_dir=host.state_dir,
            direct_runtime_command="/bin/sleep infinity",
            direct_runtime_uids=UIDS,
            affinity_addr="127.0.0.1:50999",
            plaintext=True,
        ),
        CredentialIssuer(SigningKey.from_file(host.signing_key), redis, redis_prefix, ttl_s=3600),
    )
    await substrate.start()

    def record_uid(sandbox_id: str) -> int:
        record = json.loads((host.state_dir / sandbox_id / "runtime.json").read_text())
        uid: int = record["uid"]
        return uid

    try:
        globex = RuntimeSpec(sandbox_id="globex--a", tier="", client_label="globex")
        await substrate.ensure_runtime(globex, substrate.plan(globex), no_gate)
        uid = record_uid("globex--a")
        secret = host.state_dir / "globex--a" / "workspace" / "notes.txt"
        secret.write_text("globex's")
        os.chown(secret, uid, parse_range(UIDS).start)
        assert read_as(uid, secret).stdout == b"globex's"  # its own runtime reads it
        assert await substrate.stop_runtime("globex--a")

        acme = RuntimeSpec(sandbox_id="acme--b", tier="", client_label="acme")
        await substrate.ensure_runtime(acme, substrate.plan(acme), no_gate)
        assert record_uid("acme--b") == uid  # the stopped sandbox's uid, free again
        denied = read_as(uid, secret)
        assert denied.returncode != 0
        assert b"Permission denied" in denied.stderr
        assert secret.stat().st_uid == uid  # closed by its directory, not by moving files

        # Restored while acme--b holds the uid: the workspace is its new uid's, reachable.
        restore = RuntimeSpec(sandbox_id="globex--a", tier="", client_label="globex", restore=True)
        await substrate.ensure_runtime(restore, substrate.plan(restore), no_gate)
        moved = record_uid("globex--a")
        assert moved != uid
        assert read_as(moved, secret).stdout == b"globex's"
        assert read_as(uid, secret).returncode != 0
    finally:
        for sandbox_id in ("globex--a", "acme--b"):
            await substrate.stop_runtime(sandbox_id)
        await substrate.close()


@AS_ROOT
async def test_a_runtime_that_died_takes_what_escaped_its_group_with_it(
    host: Host, reports: Reports, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process: its leader killed outside the substrate, the runtime is found not
    running, and the process that left its group (same uid) is killed then."""
    monkeypatch.setenv("PRY_PORT", str(reports.port))
    monkeypatch.setenv("PRY_TARGETS", "")
    monkeypatch.setenv("PRY_ESCAPE", "1")
    substrate = DirectSubstrate(
        SubstrateSettings(
            direct_state_dir=host.state_dir,
            direct_runtime_command=SHELL_COMMAND,
            direct_runtime_uids=UIDS,
            direct_runtime_env_allow="PRY_PORT,PRY_TARGETS,PRY_ESCAPE",
            affinity_addr="127.0.0.1:50999",
            plaintext=True,
        )
    )
    await substrate.start()
    try:
        spec = RuntimeSpec(sandbox_id="sb-1", tier="", client_label="acme")
        await substrate.ensure_runtime(spec, substrate.plan(spec), no_gate)
        report = await reports.next()
        record = json.loads((host.state_dir / "sb-1" / "runtime.json").read_text())
        escaped_ticks = processes.start_ticks(report.escaped)
        assert escaped_ticks is not None
        os.kill(record["pid"], signal.SIGKILL)
        assert await processes.wait_exit(record["pid"], record["start_ticks"], 10)
        assert await substrate.find_running("sb-1") is None
        assert not processes.is_alive(report.escaped, escaped_ticks)
        assert report.uid not in processes.live_uids(parse_range(UIDS))
    finally:
        await substrate.close()


@AS_ROOT
async def test_runtimes_started_side_by_side_each_get_a_uid_of_their_own(host: Host) -> None:
    """Starts run in threads at once: the reservation keeps two of them off one uid,
    and the sandbox-class copy is written by one at a time."""
    substrate = DirectSubstrate(
        SubstrateSettings(
            direct_state_dir=host.state_dir,
            direct_runtime_command="/bin/sleep infinity",
            direct_runtime_uids=UIDS,
            affinity_addr="127.0.0.1:50999",
            plaintext=False,
            tls_ca_file=host.tls_dir / "ca.crt",
            direct_worker_tls_cert_file=host.tls_dir / "worker.crt",
            direct_worker_tls_key_file=host.tls_dir / "worker.key",
        )
    )
    await substrate.start()
    sandboxes = [f"sb-{n}" for n in range(8)]
    try:
        specs = [RuntimeSpec(sandbox_id=sb, tier="", client_label="acme") for sb in sandboxes]
        starts = (substrate.ensure_runtime(s, substrate.plan(s), no_gate) for s in specs)
        await asyncio.gather(*starts)
        uids = [
            json.loads((host.state_dir / sb / "runtime.json").read_text())["uid"]
            for sb in sandboxes
        ]
        assert len(set(uids)) == len(sandboxes)
        assert set(uids) <= processes.live_uids(parse_range(UIDS))
        copy = host.state_dir / "worker-tls" / "tls.key"
        assert copy.read_bytes() == (host.tls_dir / "worker.key").read_bytes()
        assert not list(copy.parent.glob(".*.tmp"))
    finally:
        await asyncio.gather(*(substrate.stop_runtime(sb) for sb in sandboxes))
        await substrate.close()


@AS_ROOT
async def test_one_shared_runtime_user_is_kept_from_the_substrates_files(
    host: Host, reports: Reports, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TURNSTILE_DIRECT_RUNTIME_USER=nobody``: the keys stay unreadable; runtimes share
    the user (the residual risk docs/security.md names), and the substrate does not
    sweep a shared uid's processes when one runtime stops."""
    nobody = pwd.getpwnam("nobody")
    targets = [*map(str, host.key_files.values()), f"/proc/{os.getpid()}/environ"]
    monkeypatch.setenv("PRY_PORT", str(reports.port))
    monkeypatch.setenv("PRY_TARGETS", ":".join(targets))
    substrate = DirectSubstrate(
        SubstrateSettings(
            direct_state_dir=host.state_dir,
            direct_runtime_command=SHELL_COMMAND,
            direct_runtime_user="nobody",
            direct_runtime_env_allow="PRY_PORT,PRY_TARGETS",
            affinity_addr="127.0.0.1:50999",
            plaintext=True,
        )
    )
    await substrate.start()
    try:
        for sandbox_id in ("sb-1", "sb-2"):
            spec = RuntimeSpec(sandbox_id=sandbox_id, tier="", client_label="acme")
            await substrate.ensure_runtime(spec, substrate.plan(spec), no_gate)
        reported = [await reports.next(), await reports.next()]
        assert {(r.uid, r.euid) for r in reported} == {(nobody.pw_uid, nobody.pw_uid)}
        for report in reported:
            assert set(targets) <= report.denied
        second = json.loads((host.state_dir / "sb-2" / "runtime.json").read_text())
        assert await substrate.stop_runtime("sb-1")
        assert processes.is_alive(second["pid"], second["start_ticks"])  # not swept
    finally:
        for sandbox_id in ("sb-1", "sb-2"):
            await substrate.stop_runtime(sandbox_id)
        await substrate.close()


@AS_ROOT
def test_a_root_substrate_names_who_its_runtimes_run_as(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="TURNSTILE_DIRECT_RUNTIME_UIDS"):
        DirectSubstrate(SubstrateSettings(direct_state_dir=tmp_path / "direct"))
    both = SubstrateSettings(
        direct_state_dir=tmp_path / "direct", direct_runtime_uids=UIDS, direct_runtime_user="nobody"
    )
    with pytest.raises(ValueError, match="set one of"):
        DirectSubstrate(both)


@AS_ROOT
async def test_a_state_dir_other_uids_cannot_reach_is_refused(tmp_path: Path) -> None:
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    os.chmod(hidden, 0o700)
    substrate = DirectSubstrate(
        SubstrateSettings(
            direct_state_dir=hidden / "direct", direct_runtime_uids=UIDS, plaintext=True
        )
    )
    with pytest.raises(ValueError, match="not searchable by others"):
        await substrate.start()


def test_uids_are_handed_out_one_per_runtime_and_cleared_first() -> None:
    cleared: list[int] = []
    users = RuntimeUsers(uids=range(2700000, 2700004), clear=lambda uid, gid: cleared.append(uid))
    users.adopt("running", 2700002)  # found running after a restart
    first, second = users.acquire(), users.acquire(preferred=2700002)
    assert first is not None
    assert second is not None
    assert (first.uid, second.uid) == (2700000, 2700001)  # 2700002 is held: not preferred
    assert first.gid == second.gid == 2700000
    assert cleared == [2700000, 2700001]  # no process of an earlier runtime survives
    users.bind("sb-1", first)
    users.release(second)  # its start failed
    third = users.acquire()
    assert third is not None
    assert third.uid == 2700001
    users.bind("sb-3", third)
    last = users.acquire()
    assert last == Identity(2700003, 2700000)
    with pytest.raises(RuntimeError, match="every uid"):
        users.acquire()
    users.unbind("sb-1")  # its runtime ended
    users.release(last)
    again = users.acquire(preferred=2700000)
    assert again is not None
    assert again.uid == 2700000


# -- the allowlist, as any user --------------------------------------------------


def test_the_environment_is_the_allowlist_the_home_and_the_worker_settings() -> None:
    substrate_env = {
        **SECRETS,
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_TIME": "en_GB.UTF-8",
        "TZ": "UTC",
        "HOME": "/root",
        "TURNSTILE_LOG_LEVEL": "DEBUG",
        "TURNSTILE_PORT": "50052",
        "SSH_AUTH_SOCK": "/tmp/agent.sock",
        "KUBECONFIG": "/root/.kube/config",
        "EXTRA": "passed because it is named",
    }
    worker = {"TURNSTILE_WORKER_SANDBOX_ID": "sb-1", "PATH": "ignored-no-it-wins"}
    env = runtime_environment(substrate_env, parse_names("EXTRA"), "/state/sb-1/workspace", worker)
    assert env == {
        "PATH": "ignored-no-it-wins",
        "LANG": "C.UTF-8",
        "LC_TIME": "en_GB.UTF-8",
        "TZ": "UTC",
        "HOME": "/state/sb-1/workspace",
        "TURNSTILE_LOG_LEVEL": "DEBUG",
        "EXTRA": "passed because it is named",
        "TURNSTILE_WORKER_SANDBOX_ID": "sb-1",
    }


@pytest.mark.parametrize("value", ["AWS_*", "A B", "1ABC", "LC_*,PATH"])
def test_the_allowlist_extension_takes_exact_names_only(value: str) -> None:
    with pytest.raises(ValueError, match="TURNSTILE_DIRECT_RUNTIME_ENV_ALLOW"):
        parse_names(value)


async def test_a_runtime_of_the_substrates_own_uid_still_gets_only_the_allowlist(
    state_dir: Path, reports: Reports, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wherever uids cannot change (a non-root substrate), the environment is still
    the allowlist: this runs as any user."""
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PRY_PORT", str(reports.port))
    program = "import sys, turnstile_testing.prying_runtime as pry; sys.exit(pry.main())"
    substrate = DirectSubstrate(
        SubstrateSettings(
            direct_state_dir=state_dir,
            direct_runtime_command=f"{sys.executable} -c {shlex.quote(program)}",
            direct_runtime_user=str(os.getuid()),
            direct_runtime_env_allow="PRY_PORT",
            affinity_addr="127.0.0.1:50999",
            plaintext=True,
        )
    )
    await substrate.start()
    try:
        spec = RuntimeSpec(sandbox_id="sb-1", tier="", client_label="acme")
        await substrate.ensure_runtime(spec, substrate.plan(spec), no_gate)
        report = await reports.next()
        assert report.uid == os.getuid()
        assert not set(SECRETS) & set(report.env)
        assert all(allowed_name(name) for name in report.env), sorted(report.env)
        assert report.env["HOME"] == str(state_dir / "sb-1" / "workspace")
        for secret in SECRETS.values():
            assert secret.encode() not in report.everything
        assert await substrate.stop_runtime("sb-1")
    finally:
        await substrate.close()


async def no_gate() -> None:
    return None


def test_kill_user_sweeps_every_process_of_a_uid() -> None:
    if os.geteuid() != 0:
        pytest.skip("starting a process as another uid needs root")
    uid = parse_range(UIDS).stop - 1
    sleeper = subprocess.Popen(["/bin/sleep", "infinity"], user=uid, group=uid, extra_groups=[])
    try:
        assert uid in processes.live_uids()
        assert processes.live_uids(range(uid, uid + 1)) == {uid}  # the filtered scan sees it
        assert processes.kill_user(uid) >= 1
        sleeper.wait(timeout=10)
        assert sleeper.returncode == -signal.SIGKILL
        assert uid not in processes.live_uids()
    finally:
        sleeper.kill()
        sleeper.wait()
