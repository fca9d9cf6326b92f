"""Fixed collective algorithms as schedules (torch-free), one file per technique; `registry`
picks one by the config's name."""
