"""``turnstilectl completion bash|zsh``: the script a real shell loads completes
commands, verbs, options and choices the parser accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from turnstile_cli.cli import run
from turnstile_cli.parser import build_parser


@pytest.fixture
def bash_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    assert run(["completion", "bash"]) == 0
    path = tmp_path / "turnstilectl.bash"
    path.write_text(capsys.readouterr().out)
    return path


def _complete(script: Path, *words: str) -> list[str]:
    """What bash offers for the last of ``words`` (``COMP_WORDS``, as bash fills it)."""
    done = subprocess.run(
        [
            "bash",
            "-c",
            'source "$0"; COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); _turnstilectl; '
            'printf "%s\\n" "${COMPREPLY[@]}"',
            str(script),
            "turnstilectl",
            *words,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    return done.stdout.split()


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        (("act",), ["activate"]),
        (("keys", "al"), ["allow"]),
        (("limits", "show", "--clu"), ["--cluster"]),
        (("admit", "sb-1", "--kind", "w"), ["warm"]),
        (("-o", "y"), ["yaml"]),
        (("hold", "c"), ["commit", "cancel"]),
        (("sandboxes", "--page"), ["--page-token"]),
    ],
)
def test_bash_completes_what_the_parser_accepts(
    bash_script: Path, words: tuple[str, ...], expected: list[str]
) -> None:
    assert _complete(bash_script, *words) == expected


def test_bash_offers_every_command(bash_script: Path) -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert commands is not None
    assert set(commands) <= set(_complete(bash_script, ""))


def test_bash_completes_a_certificate_option_with_file_names(
    bash_script: Path, tmp_path: Path
) -> None:
    (tmp_path / "acme.crt").write_text("x")
    assert _complete(bash_script, "status", "--cert", str(tmp_path / "acme.c")) == [
        str(tmp_path / "acme.crt")
    ]


def test_zsh_loads_the_script_through_bashcompinit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["completion", "zsh"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#compdef turnstilectl\n")
    assert "bashcompinit" in script
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("zsh is not installed (the script's bash part is tested above)")
    path = tmp_path / "_turnstilectl"
    path.write_text(script)
    done = subprocess.run(
        [
            zsh,
            "-f",
            "-c",
            f'autoload -U compinit && compinit -u && source "{path}" && '
            "(( $+functions[_turnstilectl] )) && echo loaded",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.stdout.strip() == "loaded", done.stderr
