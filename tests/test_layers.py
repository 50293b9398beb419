"""The layers a newcomer reads: no import circle between the project's modules (imports inside functions
count too), rlhf_core never imports Prefect or the flows, and rlhf_core's rooms import only downwards."""
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


# rlhf_core's rooms, bottom up (rlhf_core/__init__.py draws them): a room imports only from rooms of a lower rank.
ROOMS = {"store": 0, "demo": 0, "inputs": 1, "rl": 1, "runtime": 1, "train": 2, "rollout": 3, "ppo": 4}


def _upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    room = lambda m: m.split(".")[1] if m.startswith("rlhf_core.") else None  # noqa: E731
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if room(m) and room(d) and room(m) != room(d) and ROOMS[room(d)] >= ROOMS[room(m)])


def test_rlhf_core_is_rooms_that_import_downwards_only():
    core = ROOT / "rlhf_core"
    assert sorted(p.name for p in core.glob("*.py")) == ["__init__.py"], "a flat module at rlhf_core's root"
    rooms = sorted(p.name for p in core.iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(ROOMS), rooms
    for r in rooms:  # each room says what it holds
        doc = ast.get_docstring(ast.parse((core / r / "__init__.py").read_text()))
        assert doc and len(doc) > 120, r
    assert _upward(_graph()) == []
    # the check sees an arrow up (rollout -> ppo, as rewards -> ppo.devices did before issue 34)
    assert _upward({"rlhf_core.rollout.rewards": {"rlhf_core.ppo.devices"}, "rlhf_core.ppo.devices": set()}) == [
        ("rlhf_core.rollout.rewards", "rlhf_core.ppo.devices")]


def test_stages_never_import_flows():
    graph = _graph()
    assert not [(m, d) for m, deps in graph.items() for d in deps if m.startswith("stages") and d.startswith("flows")]


def test_a_stage_imports_neither_prefect_nor_ray():
    """Flows own Prefect (flows/tasks.py wraps each stage's run); a stage starting actors imports Ray inside the
    function that does: so a stage runs where only its own dependencies are installed (a GPU machine with
    DeepSpeed and pydantic)."""
    import subprocess
    import sys

    names = sorted(p.stem for p in (ROOT / "stages").glob("*.py") if p.stem != "__init__")
    code = ("import importlib, sys\n"
            f"for n in {names!r}:\n"
            "    importlib.import_module('stages.' + n)\n"
            "print(sorted(m for m in ('prefect', 'ray', 'vllm', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert "ppo" in names and "dpo" in names
