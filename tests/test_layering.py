"""The layering of the package, checked on every module's imports (parsed, not executed).

From the bottom: kernels/ and kv/ import nothing of ours above them; step.py sits on kv/ (imports
nothing of ours); weights/ (loading) never imports runtime/, engine/ or server/; models/ never imports
runtime/, engine/ or server/; runtime/ never imports engine/ or server/; engine/ never imports server/.
The artifact compiler (compiler.py) and the CLI sit above everything they combine.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "slipstream"

# layer -> our packages/modules it may import (besides itself); anything else of ours is a violation
ALLOWED = {
    "errors": set(),
    "kernels": {"errors"},
    "kv": {"errors"},
    "step": set(),
    "config": {"errors"},
    "weights": {"errors", "config", "kernels", "tokenizer", "weights"},
    "models": {"errors", "config", "kernels", "kv", "step", "weights"},
    "runtime": {"errors", "config", "kernels", "kv", "step", "weights", "models"},
    "engine": {"errors", "config", "kernels", "kv", "step", "weights", "models", "runtime", "tokenizer",
               "structured"},
    "structured": {"errors"},   # grammars, tool-call parsers, reasoning: below the engine and the server
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `slipstream...` import in the file, lazy ones (inside functions) included."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("slipstream.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("slipstream."):
                out.append((node.lineno, node.module))
            elif node.module == "slipstream":
                out += [(node.lineno, f"slipstream.{a.name}") for a in node.names]
    return out


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        out.append((".".join(rel.parts), path))
    return out


def violations() -> list[str]:
    bad = []
    for module, path in _modules():
        layer = _layer(module)
        if layer not in ALLOWED:
            continue
        allowed = ALLOWED[layer] | {layer}
        for line, imported in _imports(path):
            target = _layer(imported)
            if target not in allowed and imported != "slipstream":
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({layer}) imports {imported}")
    return bad


def test_no_layer_imports_a_higher_one():
    assert violations() == []


@pytest.mark.parametrize("layer", ["kernels", "kv"])
def test_the_bottom_layers_exist(layer):
    """The check above means something only while these folders hold modules."""
    assert any(_layer(m) == layer for m, _ in _modules())


def test_the_checker_catches_an_upward_import(tmp_path, monkeypatch):
    pkg = tmp_path / "slipstream" / "kv"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text("def f():\n    from slipstream.engine.engine import Engine\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path / "slipstream")
    assert violations() == ["slipstream/kv/bad.py:2 (kv) imports slipstream.engine.engine"]
