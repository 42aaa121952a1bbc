"""``turnstilectl completion bash|zsh``: a shell completion script made from the parser.

The script is generated from :func:`turnstile_cli.parser.build_parser` itself,
so every command, verb, option and choice it completes is one the CLI accepts,
and it runs no ``turnstilectl`` while completing (a completion that started
Python on every Tab would take a tenth of a second each). zsh loads the same
script through ``bashcompinit``, zsh's own bash-completion layer.

    eval "$(turnstilectl completion bash)"     # in ~/.bashrc
    eval "$(turnstilectl completion zsh)"      # in ~/.zshrc, after compinit
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

SHELLS = ("bash", "zsh")

#: Options whose value is a path: completed with file names.
_PATH_DESTS = frozenset({"tls_dir", "state_dir"})


@dataclass
class _Level:
    """What one command (or one verb of it) accepts."""

    words: list[str] = field(default_factory=list)
    #: option → its choices (completed after the option).
    choices: dict[str, list[str]] = field(default_factory=dict)
    #: options whose value is a file.
    files: list[str] = field(default_factory=list)
    #: verb name → what it accepts.
    verbs: dict[str, _Level] = field(default_factory=dict)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The commands (or verbs) ``--help`` lists: a hidden alias (``limits get``,
    declared without help) is accepted but never offered."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest for choice in action._choices_actions}
            return {name: sub for name, sub in action.choices.items() if name in listed}
    return {}


def _level(parser: argparse.ArgumentParser) -> _Level:
    level = _Level()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        if not action.option_strings:
            if action.choices is not None:  # a positional with choices (``hold commit``)
                level.words += [str(c) for c in action.choices]
            continue
        level.words += action.option_strings
        for option in action.option_strings:
            if action.choices is not None:
                level.choices[option] = [str(c) for c in action.choices]
            elif action.metavar == "FILE" or action.dest in _PATH_DESTS:
                level.files.append(option)
    for name, sub in _subcommands(parser).items():
        level.verbs[name] = _level(sub)
        level.words.insert(0, name)
    return level


def bash_script(parser: argparse.ArgumentParser) -> str:
    prog = parser.prog
    fn = "_" + prog.replace("-", "_")
    top = _level(parser)
    detect_cmd = " | ".join(shlex.quote(n) for n in top.verbs)
    verb_cases: list[str] = []
    word_cases = [f"        /) words={shlex.quote(' '.join(top.words))} ;;"]
    choice_cases: list[str] = []
    file_options: set[str] = set(top.files)

    def add(key: str, level: _Level) -> None:
        word_cases.append(
            f"        {shlex.quote(key)}) words={shlex.quote(' '.join(level.words))} ;;"
        )
        for option, values in level.choices.items():
            choice_cases.append(
                f"        {shlex.quote(key.split('/')[0] + ':' + option)}) "
                f"words={shlex.quote(' '.join(values))} ;;"
            )
        file_options.update(level.files)

    for option, values in top.choices.items():
        choice_cases.append(f"        *:{option}) words={shlex.quote(' '.join(values))} ;;")
    for name, level in top.verbs.items():
        add(f"{name}/", level)
        inherited = [w for w in level.words if w.startswith("-")]
        for verb, inner in level.verbs.items():
            verb_cases.append(f"                {shlex.quote(name + '/' + verb)}) verb={verb} ;;")
            # A verb takes its command's options too (``keys allow --redis-url …``).
            inner.words += [w for w in inherited if w not in inner.words]
            add(f"{name}/{verb}", inner)
    files = "|".join(f"*:{o}" for o in sorted(file_options)) or "*:--no-such-option"
    nl = "\n"
    return f"""# {prog} completion for bash: eval "$({prog} completion bash)"; from its parser.
{fn}() {{
    local cur prev cmd="" verb="" words="" i w
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        if [[ -z "$cmd" ]]; then
            case "$w" in {detect_cmd}) cmd="$w" ;; esac
        elif [[ -z "$verb" ]]; then
            case "$cmd/$w" in
{nl.join(verb_cases)}
            esac
        fi
    done
    case "$cmd:$prev" in
        {files}) COMPREPLY=($(compgen -f -- "$cur")); return ;;
    esac
    case "$cmd:$prev" in
{nl.join(choice_cases)}
    esac
    if [[ -z "$words" ]]; then
        case "$cmd/$verb" in
{nl.join(word_cases)}
        esac
    fi
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
}}
complete -F {fn} {prog}
"""


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script for ``shell`` (``bash`` or ``zsh``)."""
    body = bash_script(parser)
    if shell == "zsh":
        return (
            f"#compdef {parser.prog}\n"
            "# zsh runs the bash completion through its bashcompinit layer.\n"
            "autoload -U +X bashcompinit && bashcompinit\n" + body
        )
    return body
