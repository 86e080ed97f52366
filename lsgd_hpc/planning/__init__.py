"""Planning before a run: the cost model (costmodel), python -m lsgd_hpc.plan (plan) and the
network probe (netprobe)."""
