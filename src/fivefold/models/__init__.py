"""Plain PyTorch model definitions and their presets; no parallelism lives here."""
