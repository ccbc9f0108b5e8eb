"""``shoal bench``: train real tasks with chosen strategies and compare them.

Modules: :mod:`~shoal.bench.data` (corpus, split, batches),
:mod:`~shoal.bench.tasks` (models and losses), :mod:`~shoal.bench.strategies`
(the registry), :mod:`~shoal.bench.worker` (one training process),
:mod:`~shoal.bench.runner` (runs strategies through the launcher, computes
the ideal curve) and :mod:`~shoal.bench.report` (table, JSON, plot).
Imported lazily: ``import shoal`` never pulls matplotlib.
"""
