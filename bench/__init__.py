"""`sandgate bench`: measurements side by side with a baseline, kept out of
the gateway package (import name sandgate_bench). harness.py: what every bench
shares (errors, progress, memory readings, preflight); targets.py: the kernels
and gateways they drive (jupyter-client, Kernel Gateway, ``sandgate serve``);
kernels.py: start, round trip, memory and checkpoints against jupyter-client
and Kernel Gateway;
drivers.py: the drivers side by side; restart.py: a gateway restart;
egress.py: the egress proxy against direct connections, and the 1+1 round
trip with egress on and off (egress_client.py is the HTTP client it runs on
the host and inside a sandbox); load.py: kernels driven at once (--load, and the
fleet's load run)."""
