"""How good a detector is on a labelled set: metrics, and the HTML report.

``metrics`` (image and pixel AUROC, PRO, F1 on an MVTec AD-layout category),
``report`` (``padim evaluate --report``: one self-contained HTML page from ``report.html``).

May import: :mod:`padim.core`, :mod:`padim.models.data`, :mod:`padim.models.heatmaps`,
:mod:`padim.models.verdicts`.
"""
