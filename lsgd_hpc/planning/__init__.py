"""Planning before a run: the cost model (costmodel), python -m lsgd_hpc.plan (plan), its
method recommendation and the pricing of overlapped and compressed rounds (recommend), the
defaults it assumes and its one answer with the train command (advice), the failure planner and
its goodput model (failplan, goodput) and the network probe (netprobe)."""
