"""A Prometheus for the local stack, when one is installed (Debian's ``prometheus``).

``turnstilectl up`` starts it after the services are SERVING, scraping their
metrics ports with the rules in ``deploy/prometheus/turnstile-rules.yml``, and
stops it with the stack; its data and log live in ``.run/prometheus``. With it,
the rules' alerts and the dashboard's queries (``deploy/grafana``) can be tried
against the stack: ``tests/e2e/test_e2e_dashboard.py`` does exactly that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from turnstile_cli.stack import procs

RULES = Path("deploy") / "prometheus" / "turnstile-rules.yml"
JOBS = ("turnstile-admission", "turnstile-substrate", "turnstile-affinity")


def find_binary() -> str | None:
    return shutil.which("prometheus")


def find_rules(start: Path | None = None) -> Path | None:
    """The repository's rules file: from the working directory up, then from this
    source file up (the CLI runs from the workspace's editable install)."""
    here = (start or Path.cwd()).absolute()
    for directory in (here, *here.parents, *Path(__file__).resolve().parents):
        candidate = directory / RULES
        if candidate.is_file():
            return candidate
    return None


def config(
    metrics_ports: tuple[int, int, int], rules: Path | None, *, scrape_interval_s: float
) -> str:
    """prometheus.yml for the stack's three metrics endpoints (JSON is valid YAML)."""
    interval = f"{scrape_interval_s:g}s"
    document: dict[str, object] = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for job, port in zip(JOBS, metrics_ports, strict=True)
            if port
        ],
    }
    if rules is not None:
        document["rule_files"] = [str(rules)]
    return json.dumps(document, indent=2) + "\n"


@dataclass
class LocalPrometheus:
    """One Prometheus process: :meth:`start` it, :meth:`stop` it."""

    directory: Path
    port: int
    metrics_ports: tuple[int, int, int]
    rules: Path | None
    scrape_interval_s: float = 5.0
    proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, binary: str, *, timeout_s: float = 30.0) -> bool:
        """Start and wait until ready; False (and stopped) when it is not."""
        self.directory.mkdir(parents=True, exist_ok=True)
        config_file = self.directory / "prometheus.yml"
        config_file.write_text(
            config(self.metrics_ports, self.rules, scrape_interval_s=self.scrape_interval_s)
        )
        log = (self.directory / "prometheus.log").open("wb")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={self.directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=2d",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=procs.die_with_parent,
            )
        finally:
            log.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline and self.proc.returncode is None:
            if await asyncio.to_thread(self._ready, config_file):
                return True
            await asyncio.sleep(0.2)
        await self.stop()
        return False

    def _ready(self, config_file: Path) -> bool:
        """Ours is ready: a Prometheus answers on the port, and it is the one
        reading our configuration (another one left on the port, by an earlier
        stack or anyone, answers ``/-/ready`` too while ours failed to bind)."""
        try:
            flags = f"{self.url}/api/v1/status/flags"  # our own loopback http URL
            with urllib.request.urlopen(flags, timeout=1) as answer:  # noqa: S310
                data = json.loads(answer.read()).get("data", {})
        except (OSError, ValueError, AttributeError):
            return False
        return isinstance(data, dict) and data.get("config.file") == str(config_file)

    async def stop(self, grace_s: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
