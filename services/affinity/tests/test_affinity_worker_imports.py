"""The worker agent starts without what it does not use: its imports are most of a
sandbox pod's wake (``services/affinity/bench/bench_wake.py``). Checked in a fresh
interpreter, since this test process has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys

#: Packages the worker agent never needs: Redis, PostgreSQL, Kubernetes, and the
#: other services' contracts.
UNUSED = ("redis", "asyncpg", "kubernetes_asyncio", "turnstile.admission.v1.admission_pb2")


def test_the_worker_agent_imports_no_redis_postgres_kubernetes_or_admission_contracts() -> None:
    program = (
        "import json, sys\n"
        "import turnstile_affinity.worker.__main__\n"
        f"print(json.dumps([m for m in {list(UNUSED)!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(done.stdout) == []
