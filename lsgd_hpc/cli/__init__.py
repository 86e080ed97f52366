"""The command-line programs, as thin mains over the library: train (python -m lsgd_hpc.train),
its options (config), and the preflight doctor (python -m lsgd_hpc.doctor)."""
