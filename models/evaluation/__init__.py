"""How good a detector is on a labelled set, and whether recent images still look normal to it.

``metrics`` (image and pixel AUROC, PRO, F1 on an MVTec AD-layout category),
``report`` (``padim evaluate --report``: one self-contained HTML page from ``report.html``),
``drift`` (``padim drift``: a folder of recent images read against the calibration, ``drift.html``),
``pages`` (what both HTML reports share: ``page.html``, data URIs, atomic writes).

May import: :mod:`padim.core`, :mod:`padim.models.errors`, :mod:`padim.models.choices`, :mod:`padim.models.families`,
:mod:`padim.models.options`, :mod:`padim.models.devices`, :mod:`padim.models.data`, :mod:`padim.models.config`,
:mod:`padim.models.features`, :mod:`padim.models.scoring`, :mod:`padim.models.scorer`, :mod:`padim.models.fit`,
:mod:`padim.models.deploy`.
"""
