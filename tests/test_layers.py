"""The layers a newcomer reads: no import circle between the project's modules (imports inside functions
count too), and rlhf_core never imports Prefect or the flows."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rlhf_core", "stages", "flows")


def _graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = {}
    for pkg in PACKAGES:
        for f in (root / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    target = f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                    if target in mods and target != m:
                        graph[m].add(target)
            elif isinstance(node, ast.Import):
                graph[m] |= {a.name for a in node.names if a.name in mods and a.name != m}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_the_projects_modules():
    assert _circles(_graph()) == []
    # the detector sees a circle through an import inside a function (store <-> models, before issue 25)
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_rlhf_core_imports_neither_prefect_nor_the_flows():
    for f in (ROOT / "rlhf_core").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            assert not any(n.split(".")[0] in ("prefect", "flows", "stages") for n in names), (f, names)
