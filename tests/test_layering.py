"""The import layering of src/fivefold, read from the source with `ast` (no fivefold import).

Every Import/ImportFrom node anywhere in a file counts, function bodies included, because a
function-level import runs as surely as a module-level one once the function is called. The
layers, bottom to top: config/validate, models, comm and memory, parallel, train, and the
command line (cli.py and the other top-level modules) that ties them to the planner. The
planner's predicting modules must run where torch is not installed, so none of them may reach
torch through any chain of imports; `planner.calibrate` measures the machine and is exempt.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# (importer prefix, forbidden target prefixes, the rule as a reader would say it)
FORBIDDEN = [
    ("fivefold.models", ("fivefold.parallel", "fivefold.train", "fivefold.planner",
                         "fivefold.comm", "fivefold.memory"),
     "models/ is plain PyTorch: it may import only config and validate of fivefold"),
    ("fivefold.parallel", ("fivefold.train", "fivefold.planner"),
     "parallel/ is applied from outside by train/: it imports neither train/ nor planner/"),
    ("fivefold.train", ("fivefold.planner",),
     "train/ does not import planner/; the command line ties them together"),
    ("fivefold.comm", ("fivefold.parallel", "fivefold.train", "fivefold.planner"),
     "comm/ sits below parallel/: it imports none of parallel/, train/, planner/"),
    ("fivefold.memory", ("fivefold.train", "fivefold.planner"),
     "memory/ sits below train/: it imports neither train/ nor planner/"),
    ("fivefold.planner", ("fivefold.cli", "fivefold.plan_commands"),
     "planner/ is a library: the command line imports it, never the other way"),
]
TORCH_FREE = "fivefold.planner"
TORCH_ALLOWED = ("fivefold.planner.calibrate",)


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_name(path: Path, src: Path) -> tuple[str, bool]:
    """Dotted module name of a file under src, and whether it is a package's __init__."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """Every absolute name an Import/ImportFrom anywhere in the tree asks for, with its line;
    `from a import b` yields both a.b (b may be a module) and a, relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.append((base, node.lineno))
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return names


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """Module -> {imported module: line}. Fivefold names resolve to the longest prefix that is
    a module of the tree; anything else is the external top-level package (torch, numpy)."""
    graph = {}
    for module, (text, is_package) in sources.items():
        edges = {}
        for name, line in imported_names(ast.parse(text), module, is_package):
            if name.split(".")[0] != "fivefold":
                target = name.split(".")[0]
            else:
                parts = name.split(".")
                while parts and ".".join(parts) not in sources:
                    parts.pop()
                target = ".".join(parts)
            if target and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def read_sources(src: Path = SRC) -> dict[str, tuple[str, bool]]:
    sources = {}
    for path in sorted((src / "fivefold").rglob("*.py")):
        module, is_package = module_name(path, src)
        sources[module] = (path.read_text(), is_package)
    return sources


def layer_breaches(graph: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for module, edges in sorted(graph.items()):
        for importer, targets, rule in FORBIDDEN:
            if not within(module, importer):
                continue
            for target, line in sorted(edges.items()):
                if any(within(target, t) for t in targets):
                    out.append(f"{module} (line {line}) imports {target}: {rule}")
    return out


def chain_to(graph: dict[str, dict[str, int]], start: str, goal: str) -> list[str] | None:
    """Shortest import chain start -> ... -> goal (breadth first), or None."""
    parent = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        if node == goal:
            chain = []
            while node is not None:
                chain.append(node)
                node = parent[node]
            return chain[::-1]
        for target in sorted(graph.get(node, {})):
            if target not in parent:
                parent[target] = node
                queue.append(target)
    return None


def torch_breaches(graph: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for module in sorted(graph):
        if not within(module, TORCH_FREE) or module in TORCH_ALLOWED:
            continue
        chain = chain_to(graph, module, "torch")
        if chain:
            out.append(f"{module} reaches torch through {' -> '.join(chain)}: the planner's "
                       "predicting modules run without torch (only planner.calibrate may)")
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """One message per strongly connected group of fivefold modules (Tarjan), with one cycle."""
    inner = {m: [t for t in sorted(e) if t in graph] for m, e in graph.items()}
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in inner[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(inner):
        if node not in index:
            visit(node)
    out = []
    for group in groups:
        first = min(group)
        sub = {m: {t: 0 for t in inner[m] if t in group} for m in group}
        back = min(t for t in group if first in sub[t])
        chain = chain_to(sub, first, back) + [first]
        out.append(f"import cycle {' -> '.join(chain)}: fivefold modules form no cycles "
                   "(function-level imports count)")
    return out


def all_breaches(graph: dict[str, dict[str, int]]) -> list[str]:
    return layer_breaches(graph) + torch_breaches(graph) + cycles(graph)


def test_source_tree_is_read():
    graph = import_graph(read_sources())
    assert len(graph) > 50 and "fivefold.planner.simulate" in graph
    assert "torch" in graph["fivefold.models.llama"]


def test_layering_rules_hold():
    breaches = all_breaches(import_graph(read_sources()))
    assert not breaches, "\n".join(breaches)


def test_checker_reports_a_synthetic_breach_of_each_rule():
    sources = {
        "fivefold": ("", True),
        "fivefold.models": ("", True),
        "fivefold.models.m": ("def f():\n    from fivefold.train import t\n", False),
        "fivefold.train": ("", True),
        "fivefold.train.t": ("import torch\nfrom ..planner import p\n", False),
        "fivefold.planner": ("", True),
        "fivefold.planner.p": ("from . import q\n", False),
        "fivefold.planner.q": ("def g():\n    import fivefold.train.t\n", False),
        "fivefold.planner.calibrate": ("import torch\n", False),
    }
    graph = import_graph(sources)
    assert graph["fivefold.train.t"] == {"torch": 1, "fivefold.planner.p": 2}
    breaches = all_breaches(graph)
    assert "fivefold.models.m (line 2) imports fivefold.train.t: models/" in breaches[0]
    assert any(b.startswith("fivefold.train.t (line 2) imports fivefold.planner.p") for b in breaches)
    assert any("fivefold.planner.q -> fivefold.train.t -> torch" in b for b in breaches)
    assert not any(b.startswith("fivefold.planner.calibrate") for b in breaches)
    assert any(b.startswith("import cycle fivefold.planner.p -> fivefold.planner.q -> "
                            "fivefold.train.t -> fivefold.planner.p") for b in breaches)


if __name__ == "__main__":
    print("\n".join(all_breaches(import_graph(read_sources()))))
