"""What the services tell an API caller explains itself without the project's internal
requirement ids ("SPEC O2", "(Q3)"): those belong in comments and docstrings.

The scan reads every service's and the platform library's source and checks each
string that reaches a caller: the arguments of the error builders (``bad_field``,
``invalid_argument``, ``RichError``, ``FieldViolation``, ``retry_later``,
``dependency_error``, ``context.abort``, ``set_details``), every ``message=`` or
``details=`` keyword, and the string constants of admission's ``responses.py`` (the
refusal texts an ``Admit`` response carries), plus the Lua scripts' strings.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*sorted((ROOT / "services").glob("*/src")), ROOT / "libs" / "platform" / "src"]
#: A requirement id as the docs cite it: SPEC O2, or a bare (O2) / (SPEC Q3, Q4).
REQUIREMENT_ID = re.compile(r"\bSPEC\b|\(([A-Z]{1,2}\d{1,2})(, ?[A-Z]{1,2}\d{1,2})*\)")
BUILDERS = {
    "bad_field",
    "invalid_argument",
    "RichError",
    "FieldViolation",
    "QuotaViolation",
    "retry_later",
    "dependency_error",
    "abort",
    "abort_with_status",
    "set_details",
}
CALLER_KEYWORDS = {"message", "details", "description"}
#: Files whose every string constant is a text for callers.
CALLER_TEXT_FILES = {"responses.py"}


def _strings(node: ast.AST) -> Iterator[tuple[ast.Constant, str]]:
    for inner in ast.walk(node):
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            yield inner, inner.value


def _name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _docstrings(tree: ast.AST) -> set[int]:
    """Ids of the docstring-like constants (a module's, a class's, a function's, an
    attribute's): free to cite requirements."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }


def caller_texts(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    if path.name in CALLER_TEXT_FILES:
        for constant, text in _strings(tree):
            if id(constant) not in docs:
                yield constant.lineno, text
        return
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if _name(node) in BUILDERS:
            for argument in [*node.args, *(keyword.value for keyword in node.keywords)]:
                for constant, text in _strings(argument):
                    yield constant.lineno, text
        else:
            for keyword in node.keywords:
                if keyword.arg in CALLER_KEYWORDS:
                    for constant, text in _strings(keyword.value):
                        yield constant.lineno, text


def python_files() -> list[Path]:
    return [
        path
        for source in SOURCES
        for path in sorted(source.rglob("*.py"))
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    ]


def test_the_scan_reads_the_services_error_texts() -> None:
    """The scan is not vacuous: it sees the field texts the services send today."""
    texts = [text for path in python_files() for _, text in caller_texts(path)]
    assert len(texts) > 100, len(texts)
    assert any(text.startswith("required") for text in texts)
    assert any(REQUIREMENT_ID.search(sample) for sample in ("the client (SPEC O2)", "x (Q3)"))


def test_no_text_for_api_callers_names_a_requirement_id() -> None:
    cited = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in python_files()
        for line, text in caller_texts(path)
        if REQUIREMENT_ID.search(text)
    ]
    assert not cited, "\n".join(cited)


def test_no_lua_script_string_names_a_requirement_id() -> None:
    """Lua strings reach callers as refusal texts; comments (``--``) may cite ids."""
    cited = []
    for source in SOURCES:
        for path in sorted(source.rglob("*.lua")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("--", 1)[0]
                for literal in re.findall(r"\"[^\"]*\"|'[^']*'", code):
                    if REQUIREMENT_ID.search(literal):
                        cited.append(f"{path.relative_to(ROOT)}:{number}: {literal}")
    assert not cited, "\n".join(cited)
