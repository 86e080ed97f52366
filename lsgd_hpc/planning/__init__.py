"""Planning before a run: the cost model (costmodel), python -m lsgd_hpc.plan (plan), its
method recommendation and the pricing of overlapped and compressed rounds (recommend) and the
network probe (netprobe)."""
