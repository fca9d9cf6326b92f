"""`fivefold report`: the page of a tiny run has every section with its data, needs nothing
from the network, renders in headless Chromium with its curves drawn, and a partial run gets a
page that says what is missing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.report.plots import COLORS

STEPS, EVAL_EVERY = 4, 2
TITLES = ("fivefold run report", "Loss and validation loss", "Throughput",
          "Memory: measured against predicted", "Communication ledger: bytes per mesh axis",
          "Predicted step timeline against the measured step time", "Config")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fivefold", *args], capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def trained_run(tiny_overrides, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "run"
    sets = [a for o in tiny_overrides + [f"train.eval_every={EVAL_EVERY}"] for a in ("--set", o)]
    proc = run_cli("train", *sets, "--steps", str(STEPS), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("report", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def curve_points(page: str, gid: str) -> int:
    """Vertices of the first path inside the SVG group `gid` (one per data point)."""
    group = re.search(rf'<g id="{gid}">(.*?)</g>', page, re.S)
    assert group, f"no SVG group {gid!r} in the page"
    path = re.search(r'<path d="([^"]*)"', group.group(1))
    return len(re.findall(r"[ML]\s*-?[\d.]+\s+-?[\d.]+", path.group(1)))


def test_page_has_every_section_and_the_run_data(trained_run):
    page = (trained_run / "report.html").read_text()
    for title in TITLES:
        assert f">{title}<" in page, title
    assert curve_points(page, "train-loss") == STEPS
    assert curve_points(page, "val-loss") == 1 + STEPS // EVAL_EVERY  # with step 0's
    assert curve_points(page, "tokens-per-s") == STEPS
    assert 'id="memory-measured"' in page and 'id="memory-predicted"' in page
    assert 'id="measured-step"' in page  # the measured step time over the prediction
    assert "no collectives recorded" in page  # one rank: the ledger is empty, and says so
    assert "global_batch = 4" in page
    # self-contained: no scripts, no stylesheets or images fetched, every reference in-page
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert re.findall(r'(?:src|href)\s*=\s*"(?!#)', page) == []


@pytest.fixture(scope="module")
def chromium() -> str:
    """The browser's path; before the run is trained, so that a skip costs nothing."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    if os.environ.get("CI") == "true":
        pytest.fail("CI must render the report: install Chromium (apt-get install -y chromium)")
    pytest.skip("no chromium on PATH (Debian: apt-get install -y chromium); CI runs this")


def colour_pixels(png: Path, hex_colour: str, tolerance: int = 40):
    """Row indices of the pixels within `tolerance` per channel of `hex_colour`."""
    import numpy as np
    from PIL import Image

    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    want = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    near = (abs(rgb - want) <= tolerance).all(axis=2)
    return np.nonzero(near)[0]


def test_chromium_renders_the_curves(chromium, trained_run, tmp_path):
    import numpy as np

    shot = tmp_path / "page.png"
    proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
                           f"--screenshot={shot}", "--window-size=1000,2400",
                           (trained_run / "report.html").as_uri()],
                          capture_output=True, text=True, timeout=180)
    assert shot.is_file(), proc.stderr[-2000:]
    # A curve of STEPS points, 1.5 px wide and antialiased, covers well over 100 pixels of
    # its colour; the page's text and background (black, grey, white) are none of them.
    rows = {gid: colour_pixels(shot, COLORS[gid]) for gid in
            ("train-loss", "val-loss", "tokens-per-s", "measured")}
    for gid, found in rows.items():
        assert len(found) > 100, f"{gid}: {len(found)} pixels of its colour in the screenshot"
    # in the page's order (median rows: an antialiased edge elsewhere may match a colour):
    # the loss plot above the throughput plot above the memory bars
    middle = {gid: float(np.median(found)) for gid, found in rows.items()}
    assert middle["train-loss"] < middle["tokens-per-s"] < middle["measured"]


def test_partial_run_gets_a_page_that_says_what_is_missing(trained_run, tmp_path):
    first = (trained_run / "metrics.jsonl").read_text().splitlines()[0]
    assert "val_loss" not in json.loads(first)
    (tmp_path / "metrics.jsonl").write_text(first + "\n")  # one step, no checkpoint, no end
    proc = run_cli("report", str(tmp_path), "--out", str(tmp_path / "page.html"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (tmp_path / "page.html").read_text()
    for missing in ("no validation loss yet", "no memory report", "no predicted timeline",
                    "no config"):
        assert missing in page, missing
    assert curve_points(page, "train-loss") == 1


def test_not_a_run_directory_is_one_line(tmp_path):
    proc = run_cli("report", str(tmp_path / "nothing"))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "RUN_DIR" in proc.stderr


def test_unknown_profile_is_one_line(trained_run, tmp_path):
    proc = run_cli("report", str(trained_run), "--profile", "no-such-gpu",
                   "--out", str(tmp_path / "page.html"))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--profile" in proc.stderr
    assert not (tmp_path / "page.html").exists()
