"""Fixtures for the emulator tests: a running emulator and a real kubernetes-asyncio client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from turnstile_testing.kube_emulator import KubeEmulator

#: Short so bookmark tests finish quickly; production servers use about a minute.
BOOKMARK_INTERVAL = 0.05


@pytest.fixture
async def kube() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator(bookmark_interval=BOOKMARK_INTERVAL) as emulator:
        yield emulator


@pytest.fixture
async def v1(kube: KubeEmulator) -> AsyncIterator[Any]:
    async with kube.api_client() as api:
        yield client.CoreV1Api(api)
