"""Parts of bench/sdpa_varlen.py: timing, workloads, ours, peers, versions, experiments, report;
variants/ holds kernel packages the sweep loads beside ours."""
