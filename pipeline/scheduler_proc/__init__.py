"""scheduler_proc: the process that plans steps (no torch, no model code)."""
