"""The suite cannot hang: a per-test timeout, and a timeout on every subprocess a test starts."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCKING = {"run", "call", "check_call", "check_output"}


def _subprocess_calls(tree: ast.AST):
    for node in ast.walk(tree):
        f = getattr(node, "func", None)
        if (isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and f.value.id == "subprocess" and f.attr in BLOCKING | {"Popen"}):
            yield node, f.attr


def test_every_subprocess_in_the_tests_has_a_timeout():
    """subprocess.run & co. take timeout=; a Popen is only allowed where its file waits on it
    with a timeout (communicate(timeout=...) / wait(timeout=...))."""
    missing = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        src = path.read_text()
        waits = "communicate(timeout=" in src or ".wait(timeout=" in src
        for node, kind in _subprocess_calls(ast.parse(src)):
            has = any(k.arg == "timeout" for k in node.keywords)
            if not has and not (kind == "Popen" and waits):
                missing.append(f"{path.name}:{node.lineno} subprocess.{kind}")
    assert not missing, "subprocess calls without timeout=: " + ", ".join(missing)


def test_pytest_has_a_per_test_timeout():
    opts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < int(opts["timeout"]) <= 600
