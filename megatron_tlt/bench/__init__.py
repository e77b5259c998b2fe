"""Benchmark support: the synthetic long-tail workload, length statistics, output and
CPU records, and timing ratios. The tools/bench_*.py scripts are command lines over it.

* ``workload``: ``synthetic_workload``, ``length_stats``, ``format_length_stats``;
* ``common``: ``check_ties`` (outputs that must be identical), ``cpu_description``;
* ``stats``: ``rate_ratio``, ``plain_step_medians``, ``declined_step_ratio``,
  ``median_or_none``.

Real reasoning-gym prompts for the benchmarks come from ``megatron_tlt.tasks``.
"""
