"""Offline analysis of run directories (rundir, aggregate, summary, predictions, stats):
h5py, numpy and matplotlib only, never torch or mpi4py."""
