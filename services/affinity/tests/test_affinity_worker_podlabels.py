"""A worker in a Kubernetes pod learns its sandbox id from the pod's labels file.

The files are written the way the kubelet writes a downward-API volume: a
timestamped directory, a ``..data`` symlink to it swapped by rename, and
``labels`` pointing through ``..data``; the relay is the real service.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import pydantic
import pytest

from turnstile_affinity.worker.podlabels import (
    SANDBOX_ID_LABEL,
    SandboxIdError,
    parse_labels,
    read_sandbox_id,
)
from turnstile_affinity.worker.settings import WorkerSettings
from turnstile_platform.sandbox_credentials import PresenceClaims
from turnstile_platform.tiers import TIER_LABEL

if TYPE_CHECKING:
    from conftest import Credentials, StartAffinity, StartWorker, StartWorkerProcess

WARM_LABELS = {
    "app.kubernetes.io/managed-by": "turnstile",
    "app.kubernetes.io/name": "turnstile-worker",
    "turnstile.dev/pool": "warm",
    TIER_LABEL: "container",
}


class DownwardVolume:
    """A downward-API volume holding ``metadata.labels``, updated as the kubelet does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.generation = 0
        root.mkdir(parents=True, exist_ok=True)

    @property
    def labels_file(self) -> Path:
        return self.root / "labels"

    def write(self, labels: dict[str, str]) -> None:
        """Write a new generation and swap ``..data`` to it in one rename."""
        self.generation += 1
        data = self.root / f"..gen_{self.generation}"
        data.mkdir()
        text = "\n".join(f'{key}="{labels[key]}"' for key in sorted(labels))
        (data / "labels").write_text(text)
        temporary = self.root / "..data_tmp"
        temporary.symlink_to(data.name)
        os.replace(temporary, self.root / "..data")
        if not self.labels_file.is_symlink():
            self.labels_file.symlink_to("..data/labels")


def test_parse_labels_reads_the_kubelet_format_and_skips_what_is_not_a_label() -> None:
    text = (
        'app.kubernetes.io/name="turnstile-worker"\n'
        'turnstile.dev/sandbox-id="sb-1"\n'
        'turnstile.dev/tier=""\n'
        "garbage line\n"
        'broken="unterminated\n'
    )
    assert parse_labels(text) == {
        "app.kubernetes.io/name": "turnstile-worker",
        SANDBOX_ID_LABEL: "sb-1",
        TIER_LABEL: "",
    }


def test_a_missing_file_or_a_warm_pods_labels_name_no_sandbox(tmp_path: Path) -> None:
    volume = DownwardVolume(tmp_path / "podinfo")
    assert read_sandbox_id(volume.labels_file) is None
    volume.write(WARM_LABELS)
    assert read_sandbox_id(volume.labels_file) is None
    volume.write({**WARM_LABELS, SANDBOX_ID_LABEL: "sb-7"})
    assert read_sandbox_id(volume.labels_file) == "sb-7"


def test_a_sandbox_id_that_is_no_label_value_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "labels"
    path.write_text(f'{SANDBOX_ID_LABEL}="{"x" * 64}"')
    with pytest.raises(SandboxIdError):
        read_sandbox_id(path)


def test_settings_require_exactly_one_of_the_sandbox_id_and_its_file(tmp_path: Path) -> None:
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        WorkerSettings()
    with pytest.raises(pydantic.ValidationError, match="exactly one"):
        WorkerSettings(sandbox_id="s1", sandbox_id_file=tmp_path / "labels")
    assert WorkerSettings(sandbox_id_file=tmp_path / "labels").sandbox_id is None


async def test_a_warm_pods_worker_waits_unattached_until_adoption_labels_it_then_attaches(
    affinity: StartAffinity, worker: StartWorker, credentials: Credentials, tmp_path: Path
) -> None:
    service = await affinity()
    volume = DownwardVolume(tmp_path / "podinfo")
    volume.write(WARM_LABELS)
    handle = await worker(
        service.address,
        None,
        "container",
        capacity=3,
        wait=False,
        sandbox_id_file=volume.labels_file,
        sandbox_id_poll_s=0.02,
        credential_file=await credentials.file(
            "sb-warm-1", PresenceClaims("acme", "container", 3, "")
        ),
    )
    await asyncio.wait_for(handle.agent.waiting_for_sandbox.wait(), 10)
    assert await service.workers() == {}
    assert not handle.agent.attached.is_set()

    # The substrate's adoption patch: sandbox id and client id added, pool removed.
    adopted = {k: v for k, v in WARM_LABELS.items() if k != "turnstile.dev/pool"}
    volume.write({**adopted, SANDBOX_ID_LABEL: "sb-warm-1", "turnstile.dev/client-id": "acme"})
    await handle.attached()
    assert handle.sandbox_id == "sb-warm-1"
    workers = await service.workers()
    assert set(workers) == {"sb-warm-1"}
    assert (workers["sb-warm-1"].tier, workers["sb-warm-1"].capacity) == ("container", 3)


async def test_a_worker_whose_labels_file_appears_late_attaches_once_it_names_a_sandbox(
    affinity: StartAffinity, worker: StartWorker, credentials: Credentials, tmp_path: Path
) -> None:
    service = await affinity()
    volume = DownwardVolume(tmp_path / "podinfo")
    handle = await worker(
        service.address,
        None,
        wait=False,
        sandbox_id_file=volume.labels_file,
        sandbox_id_poll_s=0.02,
        credential_file=await credentials.file("sb-late"),
    )
    await asyncio.wait_for(handle.agent.waiting_for_sandbox.wait(), 10)
    volume.write({**WARM_LABELS, SANDBOX_ID_LABEL: "sb-late"})
    await handle.attached()
    assert set(await service.workers()) == {"sb-late"}


async def test_a_worker_stopped_before_adoption_exits_0_without_attaching(
    affinity: StartAffinity, worker_process: StartWorkerProcess, tmp_path: Path
) -> None:
    service = await affinity()
    volume = DownwardVolume(tmp_path / "podinfo")
    volume.write(WARM_LABELS)
    proc = await worker_process(
        service.address,
        "",
        TURNSTILE_WORKER_SANDBOX_ID_FILE=str(volume.labels_file),
        TURNSTILE_WORKER_SANDBOX_ID_POLL_S="0.05",
    )
    await proc.wait_for_log("waiting for the sandbox id label")
    assert await proc.terminate(signal.SIGTERM) == 0
    assert await service.workers() == {}
    assert not any(line.get("message") == "attached to the relay" for line in proc.lines)


async def test_a_worker_process_reads_its_sandbox_from_the_labels_file_and_attaches(
    affinity: StartAffinity,
    worker_process: StartWorkerProcess,
    credentials: Credentials,
    tmp_path: Path,
) -> None:
    service = await affinity()
    volume = DownwardVolume(tmp_path / "podinfo")
    volume.write({**WARM_LABELS, SANDBOX_ID_LABEL: "sb-cold"})
    proc = await worker_process(
        service.address,
        "",
        TURNSTILE_WORKER_SANDBOX_ID_FILE=str(volume.labels_file),
        TURNSTILE_WORKER_TIER="container",
        TURNSTILE_WORKER_CREDENTIAL_FILE=str(await credentials.file("sb-cold")),
    )
    attached = await proc.wait_for_log("attached to the relay")
    assert attached["sandbox_id"] == "sb-cold"
    assert set(await service.workers()) == {"sb-cold"}
    assert await proc.terminate(signal.SIGTERM) == 0


async def test_an_invalid_sandbox_id_label_exits_2_without_attaching(
    affinity: StartAffinity, worker_process: StartWorkerProcess, tmp_path: Path
) -> None:
    service = await affinity()
    path = tmp_path / "labels"
    path.write_text(f'{SANDBOX_ID_LABEL}="not/a/label"')
    proc = await worker_process(service.address, "", TURNSTILE_WORKER_SANDBOX_ID_FILE=str(path))
    await proc.wait_for_log("the pod labels name an invalid sandbox id")
    assert await asyncio.wait_for(proc.proc.wait(), 15) == 2
    assert await service.workers() == {}
