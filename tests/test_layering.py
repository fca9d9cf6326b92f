"""The import layering of src/fivefold, read from the source with `ast` (no fivefold import).

Every Import/ImportFrom node anywhere in a file counts, function bodies included: a
function-level import runs as surely as a module-level one once the function is called.
Importing `a.b.c` also runs the `__init__` of `a` and `a.b`, so those packages count as
imported too. The rules:

  config, validate, compositions,      foundations: none of parallel/, train/, planner/
  hardware, optim
  models/                              plain PyTorch: of fivefold only config (its own
                                       model checks are models.validate_model), so none of
                                       parallel/, comm/, validate, train/, planner/
  comm/                                none of parallel/, train/, planner/
  memory/                              neither train/ nor planner/
  parallel/                            applied to a model from outside: neither train/ nor
                                       planner/
  train/                               the runtime: not planner/
  planner/                             predicts without torch, through no chain of imports
                                       (calibrate, which measures the machine, may use it),
                                       and reaches the runtime through no chain of imports,
                                       calibrate included: no train/ module and no parallel/
                                       module that imports torch (an executor; the schedules
                                       and partitions it replays are torch-free data)
  cli, plan_commands, the commands     the command line, which ties train/ and planner/
  (eval, generate, report), __main__
                                       together; nothing else imports it

and no fivefold modules import each other in a cycle.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

COMMAND_LINE = ("fivefold.cli", "fivefold.plan_commands", "fivefold.generate_command",
                "fivefold.eval_command", "fivefold.report_command", "fivefold.__main__")
FOUNDATIONS = ("fivefold.config", "fivefold.model_config", "fivefold.parallel_config",
               "fivefold.train_config", "fivefold.data_config", "fivefold.comm_config",
               "fivefold.validate", "fivefold.validate_parallel", "fivefold.validate_runtime",
               "fivefold.compositions", "fivefold.hardware", "fivefold.optim")
# models/ by what it may import; the other layers by what they may not:
# (importer prefix, the prefixes it may not import, the rule)
MODELS_MAY_IMPORT = ("fivefold.models", "fivefold.config")
MODELS_RULE = "models/ is plain PyTorch; of fivefold it imports only config"
FORBIDDEN = [
    *((foundation, ("fivefold.parallel", "fivefold.train", "fivefold.planner"),
       "config, validate, hardware and optim are foundations that the layers import: they "
       "import none of parallel/, train/, planner/") for foundation in FOUNDATIONS),
    ("fivefold.parallel", ("fivefold.train", "fivefold.planner"),
     "parallel/ is applied from outside by train/: it imports neither train/ nor planner/"),
    ("fivefold.train", ("fivefold.planner",),
     "train/ does not import planner/; the command line ties them together"),
    ("fivefold.comm", ("fivefold.parallel", "fivefold.train", "fivefold.planner"),
     "comm/ sits below parallel/: it imports none of parallel/, train/, planner/"),
    ("fivefold.memory", ("fivefold.train", "fivefold.planner"),
     "memory/ sits below train/: it imports neither train/ nor planner/"),
    ("fivefold", COMMAND_LINE,
     "only the command line imports the command line (cli.py, plan_commands.py)"),
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
    package = module.split(".") if is_package else module.split(".")[:-1]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.append((base, node.lineno))
            names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return names


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """Module -> {imported module: line}. A fivefold name resolves to the longest prefix that
    is a module of the tree, plus the packages above it; anything else is its external
    top-level package (torch, numpy)."""
    graph = {}
    for module, (text, is_package) in sources.items():
        edges: dict[str, int] = {}
        for name, line in imported_names(ast.parse(text), module, is_package):
            parts = name.split(".")
            if parts[0] != "fivefold":
                targets = [parts[0]]
            else:
                while parts and ".".join(parts) not in sources:
                    parts.pop()
                targets = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
            for target in targets:
                if target != module:
                    edges[target] = min(line, edges.get(target, line))
        graph[module] = edges
    return graph


def read_sources(src: Path = SRC) -> dict[str, tuple[str, bool]]:
    sources = {}
    for path in sorted((src / "fivefold").rglob("*.py")):
        module, is_package = module_name(path, src)
        sources[module] = (path.read_text(), is_package)
    return sources


def layer_breaches(graph: dict[str, dict[str, int]]) -> list[str]:
    """One message per forbidden import, naming its most specific module (a package whose
    module is reported too is left out)."""
    out = []
    for module, edges in sorted(graph.items()):
        bad: dict[str, str] = {}  # target -> the rule it breaks
        for target in edges:
            if not within(target, "fivefold") or target == "fivefold":
                continue
            if within(module, "fivefold.models") and not any(
                    within(target, ok) for ok in MODELS_MAY_IMPORT):
                bad[target] = MODELS_RULE
            for importer, targets, rule in FORBIDDEN:
                if (within(module, importer) and module not in COMMAND_LINE
                        and any(within(target, t) for t in targets)):
                    bad[target] = rule
        out += [f"{module} (line {edges[t]}) imports {t}: {rule}" for t, rule in sorted(bad.items())
                if not any(other != t and within(other, t) for other in bad)]
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
            out.append(f"{module} reaches torch through {' -> '.join(chain)} (line "
                       f"{graph[chain[-2]]['torch']} of {chain[-2]}): the planner's predicting "
                       "modules run without torch (only planner.calibrate may import it)")
    return out


RUNTIME = "fivefold.train"


def reachable(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in graph.get(todo.pop(), {}):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def runtime_breaches(graph: dict[str, dict[str, int]]) -> list[str]:
    """One message per planner module that reaches the runtime through any chain of imports:
    a train/ module, or a parallel/ module that imports torch itself (an executor)."""
    executors = {m for m in graph if within(m, "fivefold.parallel") and "torch" in graph[m]}
    out = []
    for module in sorted(graph):
        if not within(module, TORCH_FREE):
            continue
        hits = sorted(t for t in reachable(graph, module)
                      if within(t, RUNTIME) or t in executors)
        if hits:
            chain = chain_to(graph, module, hits[0])
            out.append(f"{module} reaches the runtime through {' -> '.join(chain)}: no planner "
                       "module imports train/ or a parallel/ executor, directly or not")
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """One message per strongly connected group of fivefold modules (Tarjan), naming one
    cycle through the group's first module."""
    inner = {m: [t for t in sorted(e) if t in graph] for m, e in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in inner[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = {stack.pop()}
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for node in sorted(inner):
        if node not in index:
            visit(node)
    out = []
    for group in groups:
        first = min(group)
        sub = {m: {t: 0 for t in inner[m] if t in group} for m in group}
        back = min(m for m in group if first in sub[m])
        chain = chain_to(sub, first, back) + [first]
        out.append(f"import cycle {' -> '.join(chain)}: fivefold modules form no cycles "
                   "(function-level imports count)")
    return out


def all_breaches(graph: dict[str, dict[str, int]]) -> list[str]:
    return layer_breaches(graph) + torch_breaches(graph) + runtime_breaches(graph) + cycles(graph)


def test_source_tree_is_read():
    graph = import_graph(read_sources())
    assert len(graph) > 50 and "fivefold.planner.simulate" in graph
    assert "torch" in graph["fivefold.models.llama"]
    assert "fivefold.config" in graph["fivefold.planner.simulate"]


def test_layering_rules_hold():
    breaches = all_breaches(import_graph(read_sources()))
    assert not breaches, "\n".join(breaches)


def test_checker_reports_a_synthetic_breach_of_each_rule():
    sources = {
        "fivefold": ("", True),
        "fivefold.cli": ("from fivefold.planner import p\n", False),
        "fivefold.models": ("", True),
        "fivefold.models.m": ("import fivefold.config\ndef f():\n    from ..comm import c\n",
                              False),
        "fivefold.models.v": ("from fivefold.validate import validate_model\n", False),
        "fivefold.validate": ("from fivefold.config import Config\n", False),
        "fivefold.comm": ("", True),
        "fivefold.comm.c": ("", False),
        "fivefold.config": ("", False),
        "fivefold.train": ("", True),
        "fivefold.train.t": ("import torch.nn\nfrom ..planner import p\n", False),
        "fivefold.planner": ("", True),
        "fivefold.planner.p": ("from . import q\n", False),
        "fivefold.planner.q": ("def g():\n    import fivefold.train.t\n", False),
        "fivefold.planner.calibrate": ("import torch\nfrom fivefold.cli import main\n"
                                       "def h():\n    from fivefold import harness\n", False),
        "fivefold.harness": ("from fivefold.train import t\n", False),
    }
    graph = import_graph(sources)
    assert graph["fivefold.train.t"] == {"torch": 1, "fivefold": 2, "fivefold.planner": 2,
                                         "fivefold.planner.p": 2}
    breaches = all_breaches(graph)
    expected = [
        "fivefold.models.m (line 3) imports fivefold.comm.c: models/ is plain PyTorch",
        "fivefold.models.v (line 1) imports fivefold.validate: models/ is plain PyTorch",
        "fivefold.planner.calibrate (line 2) imports fivefold.cli: only the command line",
        "fivefold.train.t (line 2) imports fivefold.planner.p: train/ does not import planner/",
        "fivefold.planner.p reaches torch through fivefold.planner.p -> fivefold.planner.q -> "
        "fivefold.train.t -> torch (line 1 of fivefold.train.t)",
        "fivefold.planner.q reaches torch through fivefold.planner.q -> fivefold.train.t -> torch",
        "fivefold.planner.calibrate reaches the runtime through fivefold.planner.calibrate -> "
        "fivefold.harness -> fivefold.train",
        "fivefold.planner.p reaches the runtime through fivefold.planner.p -> "
        "fivefold.planner.q -> fivefold.train",
        "fivefold.planner.q reaches the runtime through fivefold.planner.q -> fivefold.train",
        "import cycle fivefold.planner.p -> fivefold.planner.q -> fivefold.train.t -> "
        "fivefold.planner.p: fivefold modules form no cycles",
    ]
    assert [b[:len(e)] for b, e in zip(breaches, expected)] == expected
    assert len(breaches) == len(expected)  # the command line and calibrate's torch are fine


def test_the_old_calibrate_path_to_the_runtime_is_caught():
    """planner.calibrate once imported fivefold.testing (inside a function), which imports
    train/: two hops, each allowed alone, that the runtime rule catches."""
    sources = read_sources()
    text, is_package = sources["fivefold.planner.calibrate"]
    sources["fivefold.planner.calibrate"] = (
        text + "\ndef _old():\n    from fivefold.testing import run_on_ranks\n", is_package)
    breaches = runtime_breaches(import_graph(sources))
    assert len(breaches) == 1
    assert breaches[0].startswith("fivefold.planner.calibrate reaches the runtime through "
                                  "fivefold.planner.calibrate -> fivefold.testing -> "
                                  "fivefold.train")


if __name__ == "__main__":
    print("\n".join(all_breaches(import_graph(read_sources()))))
