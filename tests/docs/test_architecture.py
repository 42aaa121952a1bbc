"""docs/architecture.md's platform map names every module of ``turnstile_platform``.

A newcomer finds where a thing lives from that map; a module missing from it is a
module nobody can find without reading the tree.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLATFORM = ROOT / "libs" / "platform" / "src" / "turnstile_platform"
DOC = ROOT / "docs" / "architecture.md"


def _modules() -> set[str]:
    names = {p.stem for p in PLATFORM.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in PLATFORM.iterdir() if (p / "__init__.py").is_file()}
    names |= {p.name for p in PLATFORM.glob("*.lua")}
    return names


def test_the_platform_map_names_every_module() -> None:
    section = DOC.read_text(encoding="utf-8").split("## The platform map", 1)[1]
    section = section.split("\n## ", 1)[0]
    missing = sorted(m for m in _modules() if f"`{m.removesuffix('.lua')}" not in section)
    assert not missing, f"add to docs/architecture.md's platform map: {missing}"


def test_the_module_scan_sees_the_platform() -> None:
    assert {"bounded", "leader", "authz", "sandbox_credential_renew.lua"} <= _modules()
