"""The rollout engine contract (`grpo_cli/rollout/base.RolloutEngine`) is the only way to learn what an engine can
do: outside rollout/, no `getattr`/`hasattr` is applied to an engine (a name `engine`, `*_engine`, or an attribute
`.engine`), and no engine class (one deriving from `RolloutEngine`, directly or not) forwards unknown attributes
with `__getattr__`. Both read with `ast`, over every module of the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "grpo_cli"


def _is_engine(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name is not None and (name == "engine" or name.endswith("_engine"))


def _trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(ROOT.rglob("*.py"))}


def engine_probes(trees: dict[Path, ast.Module]) -> list[str]:
    """`file:line` of each `getattr(engine, ...)`/`hasattr(engine, ...)` outside rollout/."""
    out = []
    for path, tree in trees.items():
        if path.relative_to(ROOT).parts[0] == "rollout":
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args and _is_engine(node.args[0])):
                out.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}")
    return out


def engine_classes(trees: dict[Path, ast.Module]) -> dict[str, ast.ClassDef]:
    """Every class of the package deriving from `RolloutEngine`, directly or through other classes (by name)."""
    classes = {n.name: n for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    found = {"RolloutEngine"}
    grew = True
    while grew:
        grew = False
        for name, cls in classes.items():
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in cls.bases}
            if name not in found and bases & found:
                found.add(name)
                grew = True
    return {n: classes[n] for n in found}


def test_no_engine_probing_outside_rollout():
    assert engine_probes(_trees()) == []


def test_the_probe_check_sees_a_probe():
    tree = ast.parse("def f(tr, engine):\n    hasattr(tr.engine, 'urls')\n    getattr(engine, 'dtype', None)\n")
    assert len(engine_probes({ROOT / "train" / "x.py": tree})) == 2


def test_no_engine_class_forwards_unknown_attributes():
    classes = engine_classes(_trees())
    assert {"HFEngine", "VLLMEngine", "ServerEngine", "SGLangEngine", "AsyncRolloutEngine", "AgentEngine",
            "CustomRollout"} <= classes.keys()
    forwarding = [name for name, cls in classes.items()
                  if any(isinstance(f, ast.FunctionDef) and f.name == "__getattr__" for f in cls.body)]
    assert forwarding == []
