# Two commands do all the set-up on a fresh machine:  make demo  and  make test.
VENV    ?= .venv
PY      := $(VENV)/bin/python
NP      ?= 4
READY   := $(VENV)/.lsgd_hpc_ready
# Open MPI refuses root unless told; harmless elsewhere. One thread per rank: ranks share cores.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMP_NUM_THREADS ?= 1
# The venv's mpirun (PyPI Open MPI) when there is one, else the system's.
MPIRUN  = $(shell [ -x $(VENV)/bin/mpirun ] && echo $(VENV)/bin/mpirun || echo mpirun)
MPIFLAGS ?= --oversubscribe
DEMO_DIR ?= runs/demo
# Two pytest workers: the emulated-cluster tests (one worker, mostly waiting on SLURM) beside
# the CPU-bound rest. PYTEST_PAR= runs the suite in one process. The 30 slowest tests are
# listed at the end, to keep the suite's time in view.
PYTEST_PAR ?= -n 2 --dist loadgroup

.PHONY: venv demo test test-fast bench results horovod clean

venv: $(READY)

$(READY): setup.cfg constraints.txt scripts/bootstrap.sh
	bash scripts/bootstrap.sh $(VENV)

demo: $(READY)
	rm -rf $(DEMO_DIR)
	PATH=$(abspath $(VENV))/bin:$$PATH $(MPIRUN) $(MPIFLAGS) -np $(NP) \
	    $(PY) -m lsgd_hpc.train --run-dir $(DEMO_DIR) --ranks-per-node 2
	$(PY) -m lsgd_hpc.summary $(DEMO_DIR)

test: $(READY)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -ra --durations=30 $(PYTEST_PAR) tests

# For development (under 3 minutes here): the in-process tests, and the few short mpirun tests
# marked fast (the parallel test bodies at 2 ranks per backend, the fail-fast check). make test
# is the whole suite.
test-fast: $(READY)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -q -n 2 --durations=10 \
	    -m "fast or not (mpi or cluster or netns or slow or replicas)" tests

bench: $(READY)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) benchmarks/run_all.py --out results/benchmarks

# Every experiment under results/ (about 70 min on 2 cores; the network and language-model
# ones need root for the emulated cluster). RESULTS_ARGS=--quick checks that they run.
results: $(READY)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) results/run_all.py --out results $(RESULTS_ARGS)

horovod: $(READY)
	bash scripts/install_horovod.sh $(VENV)

clean:
	rm -rf runs build *.egg-info .pytest_cache
