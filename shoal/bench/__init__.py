"""Benchmarks: real tasks and collectives on chosen (emulated) networks."""
