"""Parts of bench/sdpa_varlen.py: timing, workloads, ours, peers, versions, experiments, report;
removed (the kernel package with the paths removed from ours, from git history, for the sweep)."""
