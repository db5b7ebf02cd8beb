"""Bounds of what the statistics and the calibration accept, importable without torch (the configuration's
declaration checks against them before any tensor exists).

Example:
    >>> low, high = FALSE_ALARM_RATE_RANGE
    >>> low <= 0.01 <= high
    True
"""

#: Allowed range of the requested false-alarm rate.
FALSE_ALARM_RATE_RANGE = (1e-6, 0.5)
#: ``--shrinkage auto``: the weight of the pooled covariance estimated from the statistics
#: (:func:`padim.core.statistics.shrinkage_intensity`).
SHRINKAGE_AUTO = "auto"
#: The largest shrinkage weight, given or estimated.
SHRINKAGE_MAX = 0.95
