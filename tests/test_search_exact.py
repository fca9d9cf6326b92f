"""`fivefold plan`'s two passes (fivefold.planner.search): what the exact pass gets to see
when the fast pass's leaders do not hold up."""

from __future__ import annotations

import fivefold.planner.search as S
from fivefold.hardware import PROFILES
from fivefold.planner.search import search
from fivefold.planner.spec import spec_config
from planner_specs import spec

H100 = PROFILES["H100-SXM"]


def test_search_looks_again_when_its_leaders_do_not_fit_exactly(monkeypatch):
    """The fast pass leaves a fitting layout untimed when its compute floor is slower than
    the `exact` leaders; where those leaders then fail the exact simulation (here: made to),
    the search times the others best first and still returns `top_k` fitting layouts, the
    fastest of them the one a search simulating 24 finds."""
    cfg = spec_config(spec(model={"preset": "1B"}, cluster={"gpus": 8},
                           parallel={"global_batch": 32}))
    leaders = {e.layout.replace(stage_layers=None) for e in search(cfg, H100, 3, 3).best}
    exact = S.exact_estimate
    monkeypatch.setattr(S, "exact_estimate", lambda c, p, lay, cache: None if lay.replace(
        stage_layers=None) in leaders else exact(c, p, lay, cache))
    wide, narrow = search(cfg, H100, 3, 24).best, search(cfg, H100, 3, 3).best
    assert len(narrow) == 3 and all(e.fits for e in narrow)
    assert {e.layout.replace(stage_layers=None) for e in narrow}.isdisjoint(leaders)
    assert narrow[0].step_time_s == wide[0].step_time_s
