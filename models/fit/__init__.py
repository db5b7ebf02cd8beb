"""The fit: one backbone pass over normal images into statistics, and what it will cost.

``in_progress`` (:class:`~padim.models.fit.in_progress.Fit`, a fit in progress: pass 1 into the
spool and accumulators, then the finish: factorisation and out-of-fold calibration),
``memory_plan`` (what a fit needs in memory and on disk, said and checked before it starts),
``distributed`` (torchrun shards and their agreement on failure).

Whole runs (new, resumed, partial, merged) are :mod:`padim.models.training`, which also writes
the model file; nothing here reads or writes files but the scratch spool.

May import: :mod:`padim.core`, :mod:`padim.models.config`, :mod:`padim.models.detector`,
:mod:`padim.models.features`, :mod:`padim.models.data`.
"""
