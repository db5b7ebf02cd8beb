"""The fit: normal pictures through the backbone into statistics, the runs that make model files, and the file.

``in_progress`` (:class:`~padim.models.fit.in_progress.Fit`, a fit in progress: its embedder and statistics, wired
to its passes), ``passes`` (what the passes hand each other: training pictures, the spool, rows read slice by slice,
what a finish leaves), ``first_pass`` (pass 1: pictures through the backbone into the spool or the accumulators, and
embedded again to calibrate without one), ``finish`` (the finish: comoment, factorisation and float16 check a slice
of pixels at a time), ``fold_scores`` (the out-of-fold calibration's distances and scores), ``memory_plan`` (what a
fit needs in memory and on disk, said and checked before it starts), ``distributed`` (torchrun shards and their
agreement on failure), ``precision`` (the gate of a reduced-precision fit against float32), ``model_file`` (the
model file's format, above the types it saves: detectors and fits in progress), ``training`` (whole runs: new,
resumed, partial, merged, each ending in a model file), ``learning`` (a model taught from reviewed pictures: added,
taken out, gated against the version it replaces).

May import: :mod:`padim.core`, :mod:`padim.models.errors`, :mod:`padim.models.choices`, :mod:`padim.models.families`,
:mod:`padim.models.options`, :mod:`padim.models.devices`, :mod:`padim.models.data`, :mod:`padim.models.config`,
:mod:`padim.models.features`, :mod:`padim.models.scoring`, :mod:`padim.models.scorer`.
"""
