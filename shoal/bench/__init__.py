"""Benchmarks: real tasks and collectives on chosen (emulated) networks.

``shoal bench`` (train real tasks with chosen strategies and compare them):
:mod:`~shoal.bench.data` (corpus, split, batches), :mod:`~shoal.bench.tasks`
(models and losses), :mod:`~shoal.bench.strategies` (the registry),
:mod:`~shoal.bench.worker` (one training process), :mod:`~shoal.bench.runner`
(runs strategies through the launcher), :mod:`~shoal.bench.metrics` (time to
target, the ideal curve, efficiency) and :mod:`~shoal.bench.report` (table,
JSON schema, plot). Nothing here is imported by ``import shoal``.
"""
