"""The real ``kubectl``, pointed at the API-server emulator (fidelity checks).

Tests that want a second opinion on what the emulator serves ask the real client: it
parses the API server's answers the way operators' tools do. Each run gets a private
``HOME`` and an empty kubeconfig, so nothing from the machine leaks into it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

#: The kubectl binary, or None when it is not installed (tests then skip).
KUBECTL = shutil.which("kubectl")

Result = tuple[int, str, str]


def kubectl_argv(server: str, home: Path, namespace: str, args: tuple[str, ...]) -> list[str]:
    """The command line of ``kubectl args`` against ``server`` in ``namespace``."""
    if KUBECTL is None:
        raise RuntimeError("kubectl is not installed")
    cache = f"--cache-dir={home / 'cache'}"
    return [KUBECTL, f"--server={server}", cache, "-n", namespace, *args]


def kubectl_env(home: Path) -> dict[str, str]:
    """A private ``HOME`` and an empty kubeconfig."""
    return {"HOME": str(home), "KUBECONFIG": str(home / "none"), "PATH": os.environ["PATH"]}


async def run_kubectl(
    server: str, home: Path, namespace: str, *args: str, timeout: float = 30.0
) -> Result:
    """Run kubectl to completion: (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *kubectl_argv(server, home, namespace, args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=kubectl_env(home),
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
