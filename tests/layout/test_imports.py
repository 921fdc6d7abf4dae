"""The house's import rules (docs/architecture.md): every import of `grpo_cli`, at module level, inside a function or
under `if TYPE_CHECKING:`, read with `ast`, forms no circle between modules, and each package imports only the
packages `ALLOWED` lists for it (a list with no circle, so no two packages import each other either)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "grpo_cli"

ALLOWED: dict[str, set[str]] = {
    # the command line: parse, load the config, call one function; nothing imports cli
    "cli": {"config", "diagnose", "eval", "launch", "models", "planner", "runtime", "server", "train", "ui"},
    # commands: accelerate/torchrun, --rehearse, doctor; diagnose-mismatch; eval
    "launch": {"config", "models", "rollout", "server", "train", "ui"},
    "diagnose": {"algo", "config", "data", "models", "rollout", "runtime", "train"},
    "eval": {"agent", "config", "data", "rewards", "rollout", "runtime", "train"},
    # training: the loop, backends, weights, scoring, supervision (and the DeepSpeed JSON from planner/)
    "train": {"agent", "algo", "config", "data", "models", "planner", "rewards", "rollout", "runtime"},
    # `grpo serve-rollout` (never train; nothing in rollout imports it) and the agent loop
    "server": {"config", "data", "models", "rewards", "rollout", "runtime"},
    "agent": {"config", "rewards", "rollout", "runtime"},
    # rollout engines; never train, server, eval or agent (the trainer hands down what it needs from above)
    "rollout": {"config", "data", "models", "runtime"},
    # `grpo plan`, `--dry-run`'s plan and DeepSpeed JSON: figures from the config alone
    "planner": {"algo", "config"},
    "data": {"config", "models"},
    "rewards": {"config", "models", "runtime"},
    "models": {"algo", "config"},
    "runtime": {"config"},
    "ui": {"config"},  # the only importer of rich
    "config": set(),  # the pydantic models, presets, rules: no torch at module level either
    "algo": set(),  # pure tensor math: torch and the standard library only
}
"""{package: the grpo_cli packages it may import}; a package always imports its own modules."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """{module: the grpo_cli modules it imports}; `from pkg import sub` counts as importing `pkg.sub`."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                hit = _resolve(target, modules) if target.startswith("grpo_cli") else None
                if hit and hit != name:
                    graph[name].add(hit)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()) else None


def test_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_between_modules():
    assert circles(import_graph()) == []


def test_every_package_has_an_allow_list():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ALLOWED)


def test_the_allow_lists_form_no_circle():
    assert circles(ALLOWED) == []


def test_each_package_imports_only_what_it_is_allowed():
    pairs = {(_package(a), _package(b)) for a, targets in import_graph().items() for b in targets}
    extra = sorted(f"{a} → {b}" for a, b in pairs if a and b and a != b and b not in ALLOWED[a])
    assert extra == []
