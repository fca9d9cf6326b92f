"""Mixture-of-experts training on one process (fivefold.models.moe, fivefold.train.moe_stats).

Tolerances: the expert matmul forms and the per-token reference differ only in summation
order, fp32 on the CPU: outputs and gradients of scale ~1 agree to 1e-5. Balancing is shown
by the max/mean load imbalance a tiny trained MoE ends with, with and without the balancing
term, on the same data and initialization (a skewed router, so there is something to even).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.config import load_config
from fivefold.models.expert_matmul import expert_swiglu, grouped_mm_runs, padded_mm
from fivefold.models.moe import MoE, capacity_keep
from fivefold.train.dist import Runtime
from fivefold.train.trainer import Trainer

CPU = Runtime(0, 1, 0, torch.device("cpu"))
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32"]


def moe_module(*sets: str, seed: int = 0) -> MoE:
    cfg = load_config(None, ["model.hidden=16", "model.layers=1", *MOE, *sets])
    torch.manual_seed(seed)
    m = MoE(cfg.model)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_expert_matmul_forms_agree_with_empty_groups():
    torch.manual_seed(0)
    counts = [3, 0, 5, 1]  # expert 1 receives no token and still runs
    x = torch.randn(sum(counts), 16, requires_grad=True)
    ws = [torch.randn(4, 8, 16, requires_grad=True), torch.randn(4, 8, 16, requires_grad=True),
          torch.randn(4, 16, 8, requires_grad=True)]
    g = torch.randn(sum(counts), 16)
    results = []
    for how in ("grouped", "loop"):
        y = expert_swiglu(x, counts, *ws, how=how)
        results.append((y, torch.autograd.grad((y * g).sum(), [x, *ws])))
    (y0, g0), (y1, g1) = results
    torch.testing.assert_close(y0, y1, atol=1e-5, rtol=1e-5)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert grouped_mm_runs("cpu", torch.float32)  # torch 2.13 runs it on the CPU
    torch.testing.assert_close(padded_mm(x, ws[0], counts),
                               torch.cat([x[:3] @ ws[0][0].T, x[3:8] @ ws[0][2].T,
                                          x[8:] @ ws[0][3].T]), atol=1e-5, rtol=1e-5)


def reference_moe(m: MoE, x_ND: torch.Tensor, keep_NK: torch.Tensor | None = None):
    """Token by token: shared(x) + sum over kept top-k of the renormalized score x expert."""
    out = []
    for n, x in enumerate(x_ND):
        z = m.router.weight @ x
        s = F.softmax(z, -1) if m.score == "softmax" else torch.sigmoid(z)
        top = torch.topk(s + m.expert_bias, m.top_k).indices
        gates = s[top] / s[top].sum()
        y = m.shared(x) if m.shared is not None else torch.zeros_like(x)
        for k, (e, g) in enumerate(zip(top.tolist(), gates)):
            if keep_NK is None or keep_NK[n, k]:
                y = y + g * (m.w2[e] @ (F.silu(m.w1[e] @ x) * (m.w3[e] @ x)))
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("sets", [(), ("model.moe.score='sigmoid'", "model.moe.shared_experts=1",
                                       "model.moe.bias_update_rate=0.1")])
def test_dropless_moe_is_the_per_token_sum(sets):
    m = moe_module(*sets)
    if m.balance_bias:
        m.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(m(x).view(10, 16), reference_moe(m, x.view(10, 16)),
                               atol=1e-5, rtol=1e-5)


def test_capacity_keeps_first_choices_first_and_drops_the_rest():
    experts_NK = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    # expert 0, capacity 2: first choices of tokens 0 and 1 win; token 2's first choice and
    # token 3's second choice are dropped; expert 1: token 3's first, then token 0's second
    keep = capacity_keep(experts_NK, 3, 2)
    assert keep.tolist() == [[True, True], [True, True], [False, False], [True, False]]
    m = moe_module("model.moe.capacity_factor=0.5")
    m.train()
    x = torch.randn(12, 16)
    _, _, chosen = m.route(x)
    capacity = math.ceil(0.5 * 12 * 2 / 4)
    keep = capacity_keep(chosen, 4, capacity)
    torch.testing.assert_close(m(x[None])[0], reference_moe(m, x, keep), atol=1e-5, rtol=1e-5)
    assert m.dropped == int((~keep).sum()) > 0
    for e in range(4):
        assert int(keep[chosen == e].sum()) == min(capacity, int((chosen == e).sum()))


def test_aux_losses_add_their_scaled_gradient():
    """The attached gradient is exactly that of aux_grad_scale x (balance + z-loss sums)."""
    sets = ("model.moe.aux_loss_weight=0.1", "model.moe.z_loss_weight=0.01")
    with_aux, plain = moe_module(*sets), moe_module()
    plain.load_state_dict(with_aux.state_dict())
    with_aux.aux_grad_scale = 0.25
    x, r = torch.randn(1, 9, 16), torch.randn(1, 9, 16)
    (with_aux(x) * r).sum().backward()
    out = plain(x)  # no aux loss attached
    logits, _, chosen = plain.route(x[0])
    plain.aux_loss_weight, plain.z_loss_weight = 0.1, 0.01
    ((out * r).sum() + 0.25 * plain.aux_loss(logits, chosen)).backward()
    for (name, a), b in zip(with_aux.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert with_aux.aux_sum > 0


BALANCE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_ffn_hidden=32",
           "train.lr=1e-3", "train.steps=40"]


def final_imbalance(sets: list[str], tmp_path, name: str) -> float:
    """Mean over the last 10 of 40 steps of the worst layer's max/mean expert load."""
    trainer = Trainer(load_config(None, sets), CPU, tmp_path / name)
    imbalance = [max(s["imbalance"] for s in trainer.train_step(step).moe.values())
                 for step in range(40)]
    return sum(imbalance[-10:]) / 10


def test_aux_loss_and_bias_update_each_even_the_load(tiny_overrides, tmp_path):
    """Unbalanced, the tiny MoE collapses onto one expert per layer (imbalance near the
    top_k = 2 of 8 bound of 4); the load-balancing loss (weight 0.1) and, separately, the
    auxiliary-loss-free bias (rate 0.003) each keep it markedly more even."""
    base = tiny_overrides + BALANCE
    plain = final_imbalance(base, tmp_path, "plain")
    aux = final_imbalance(base + ["model.moe.aux_loss_weight=0.1"], tmp_path, "aux")
    bias = final_imbalance(base + ["model.moe.bias_update_rate=0.003"], tmp_path, "bias")
    assert plain > 3.5, plain
    assert aux < 0.8 * plain and bias < 0.8 * plain, (plain, aux, bias)


def test_moe_run_logs_load_statistics(tiny_overrides, tmp_path):
    """A whole run with capacity, shared experts, both losses and the bias: metrics.jsonl
    carries each MoE layer's statistics, consistent with each other, and the loss falls."""
    sets = tiny_overrides + MOE + ["model.moe.capacity_factor=1.0", "model.moe.shared_experts=1",
                                   "model.moe.aux_loss_weight=0.01",
                                   "model.moe.z_loss_weight=0.001", "model.moe.dense_layers=1",
                                   "model.moe.bias_update_rate=0.001", "train.steps=6",
                                   "train.eval_every=6", "train.tensorboard=true"]
    Trainer(load_config(None, sets), CPU, tmp_path / "run").run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["loss"] < records[0]["loss"]
    for r in records:
        assert list(r["moe"]) == ["layers.1"]  # dense_layers = 1: only the second block
        stats = r["moe"]["layers.1"]
        load = stats["tokens_per_expert"]
        assert sum(load) == 4 * 32 * 2  # global batch 4 x 32 tokens x top_k 2
        assert stats["imbalance"] == pytest.approx(max(load) / (sum(load) / 4))
        assert 0 <= stats["dropped_fraction"] < 1 and stats["aux_loss"] > 0
    assert list((tmp_path / "run" / "tb").iterdir())


def test_mixtral_from_transformers_trains_with_init_from(tiny_overrides, tmp_path):
    """A random `transformers` Mixtral (4 experts, top-2) saved and trained with
    --init-from: the first step's loss equals the transformers model's mean token loss on
    the same batch (fp32, rtol 1e-5), and the run trains on."""
    pytest.importorskip("transformers")
    from test_hf import hf_model, save  # the tiny random models of the HF tests

    from fivefold.config import apply_override
    from fivefold.train.model_source import init_from_overrides
    model = hf_model("mixtral", vocab_size=512, max_position_embeddings=32, head_dim=16)
    folder = save(model, tmp_path / "hf")
    raw: dict = {}
    for assignment in tiny_overrides:
        apply_override(raw, assignment)
    cfg = load_config(None, tiny_overrides + init_from_overrides(folder, raw))
    assert cfg.model.moe.experts == 4 and cfg.model.moe.top_k == 2
    trainer = Trainer(cfg, CPU, tmp_path / "run", init_from=folder)
    inputs, targets = trainer.train_sampler.rank_batch(0)
    with torch.no_grad():
        logits = model(inputs).logits
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    first = trainer.train_step(0)
    assert first.loss == pytest.approx(expected, rel=1e-5)
    assert sum(first.moe["layers.0"]["tokens_per_expert"]) == 4 * 32 * 2
    assert trainer.train_step(1).loss < first.loss


@pytest.mark.parametrize("name,published", [("mixtral-8x7B", 46.7e9),
                                            ("deepseek-v3-like", 671e9)])
def test_moe_preset_sizes_match_published(name, published):
    """Total parameters against the papers' (Mixtral 46.7B; DeepSeek-V3 671B, whose MLA and
    MTP module the -like preset replaces by plain attention and leaves out): within 3%."""
    from fivefold.models.flops import param_count
    cfg = load_config(None, [f"model.preset={name!r}"]).model
    assert param_count(cfg) == pytest.approx(published, rel=0.03)


@pytest.mark.slow
def test_moe_bench_quick_writes_consistent_json(tmp_path):
    """bench/moe.py --quick on 2 ranks: a row per ep degree, no all-to-all at ep 1, a share
    in (0, 1) otherwise, and the three expert-matmul forms (no timing comparisons)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / "moe.py"), "--quick",
                           "--nproc", "2", "--json", str(out)], cwd=root, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert [row["ep"] for row in res["ep"]] == [1, 2]
    assert res["ep"][0]["all_to_all_share"] == 0 and 0 < res["ep"][1]["all_to_all_share"] < 1
    assert all(row["tokens_per_s"] > 0 for row in res["ep"])
    assert [row["matmul"] for row in res["expert_matmul"]] == ["grouped", "padded", "loop"]


def test_grouped_matmul_probe_ignores_the_callers_grad_mode():
    """The probe's answer is cached for the process, and a run's first MoE forward may be an
    evaluation under no_grad: the probe must answer the same there (before, it failed its
    own backward and sent the whole run down the padded path)."""
    grouped_mm_runs.cache_clear()
    with torch.no_grad():
        under_no_grad = grouped_mm_runs("cpu", torch.float32)
    grouped_mm_runs.cache_clear()
    assert under_no_grad == grouped_mm_runs("cpu", torch.float32)
    assert under_no_grad == hasattr(torch, "_grouped_mm")  # torch 2.13 runs it on the CPU
