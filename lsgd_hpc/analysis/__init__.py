"""Offline analysis of run directories: reading them (rundir), per-run tables and CSV
(tables), groups of runs (groups), figures (plots), the aggregator program over them
(aggregate), the one-run summary (summary), predictions against measurements (predictions,
stats): h5py, numpy and matplotlib only, never torch or mpi4py."""
