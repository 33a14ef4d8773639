"""Parts of bench/sdpa_varlen.py: timing, workloads, ours, peers, versions, experiments, report."""
