"""`fivefold report RUN_DIR`: a self-contained HTML page about a training run (page.py), from
what the run directory holds (run_data.py) and the planner's prediction of its step
(predicted.py), with matplotlib figures inlined as SVG (plots.py)."""
