"""No gradient reduction is written outside the sync modules (fivefold.parallel.grad_sync for
the flat units, fivefold.parallel.grad_reduce for every other gradient), read from the source
with `ast` (no fivefold import), as tests/test_layering.py reads imports.

A gradient reduction is a call of a collective (comm's all_reduce / reduce_scatter, ZeRO++'s
quantized reduce-scatter, tensor_comm's all_reduced / reduce_scatter_stacked) that names a
gradient ledger purpose as a string: "grads", "sp_norm_grads" or "moe_sp_grads". The
planner's ledger model records these purposes too, through its own `record`, which is no
collective and is not counted.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fivefold"
SYNC_MODULES = ("parallel/grad_sync.py", "parallel/grad_reduce.py")
GRADIENT_PURPOSES = {"grads", "sp_norm_grads", "moe_sp_grads"}
COLLECTIVES = {"all_reduce", "reduce_scatter", "quantized_reduce_scatter", "all_reduced",
               "reduce_scatter_stacked"}


def gradient_reductions(source: str) -> list[int]:
    """Lines of the collective calls in `source` that name a gradient purpose."""
    tree = ast.parse(source)
    named = {t.id for node in tree.body if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Constant) and node.value.value in GRADIENT_PURPOSES
             for t in node.targets if isinstance(t, ast.Name)}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name not in COLLECTIVES:
            continue
        args = [*node.args, *(k.value for k in node.keywords)]
        if any(isinstance(a, ast.Constant) and a.value in GRADIENT_PURPOSES
               or isinstance(a, ast.Name) and a.id in named for a in args):
            lines.append(node.lineno)
    return lines


def test_the_check_finds_a_gradient_reduction():
    source = ('MOE = "moe_sp_grads"\n'
              'C.all_reduce(g, axis, "grads")\n'
              'all_reduced(g, tp, purpose="sp_norm_grads")\n'
              'C.all_reduce(loss, axis, "loss")\n'
              'ledger.record("all_reduce", "dp", 2, "float32", 4, "grads")\n'
              'zeropp.quantized_reduce_scatter(out, full, nodes, MOE)\n')
    assert gradient_reductions(source) == [2, 3, 6]


def test_no_gradient_reduction_outside_the_sync_modules():
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        lines = gradient_reductions(path.read_text())
        if lines:
            found[rel] = lines
    outside = {rel: lines for rel, lines in found.items() if rel not in SYNC_MODULES}
    assert not outside, (f"gradient reductions written outside {SYNC_MODULES}: {outside}; "
                         "call a function of fivefold.parallel.grad_reduce instead")
    assert set(found) == set(SYNC_MODULES)  # each sync module does reduce gradients
