"""fivefold: an LLM training system across the five parallel dimensions, with a planner."""

__version__ = "0.1.0"
