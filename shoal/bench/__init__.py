"""Benchmarks: tasks, network profiles, runner, report and plot."""
