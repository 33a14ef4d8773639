"""Parts of bench/sdpa_varlen.py: timing, workloads, peers, report, versions."""
