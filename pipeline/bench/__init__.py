"""``pipeline-bench``: workloads, drivers that time every token, the report; the command is in ``.cli``."""
