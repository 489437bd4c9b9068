"""`sandgate bench`: measurements side by side with a baseline, kept out of
the gateway package (import name sandgate_bench). kernels.py: start, round
trip, memory and checkpoints against jupyter-client and Kernel Gateway;
drivers.py: the drivers side by side; restart.py: a gateway restart."""
