"""What the running service holds, part by part, wired by one owner.

- ``surface``: :class:`ScoreSurface`, what the score routes ask of the process that answers them (a version, held
  for a request, its pictures scored, observed and kept): the protocol both owners name as their base.
- ``owner``: :class:`ServiceState`, the owner: settings, metrics, readiness, the device's scheduler and the pools;
  it loads and closes the parts, and answers the score routes (:class:`ScoreSurface`, which an API process's
  :class:`~padim.service.processes.api.ApiState` keeps too).
- ``served``: :class:`ServedModel`, one loaded version with its batcher and monitor.
- ``versions``: :class:`LoadedVersions`, the loaded versions, active and retired, by name and serial: installed,
  retired, held by requests and closed after the last.
- ``loading``: :class:`Loader`, a version's memory checked, loaded and warmed up on the loader thread, bound to a
  batcher of its own.
- ``scoring``: :class:`DeviceScoring`, pictures queued and scored on the device, its failures and health.
- ``changes``: :class:`RepositoryChanges`, the repository's changes (add, activate, roll back, unload, remove: the
  admin routes) and its poll.
- ``recording``: :class:`Recording`, the inspection record opened, answers counted and kept, a recorded picture's
  heat map drawn again.

A change to how versions swap belongs in ``versions``; to what a load checks or warms, ``loading``; to a GPU's
failures, ``scoring``; to the admin routes' rules, ``changes``; to what the service writes into the record,
``recording``.

May import: :mod:`padim.service.settings`, :mod:`padim.service.metrics`, :mod:`padim.service.monitor`,
:mod:`padim.service.edge`, :mod:`padim.service.record`, :mod:`padim.service.device`, :mod:`padim.service.updates`.
"""

from .owner import ServiceState
from .scoring import each
from .served import ServedModel, model_info, model_name
from .surface import ScoreSurface

__all__ = ["ScoreSurface", "ServedModel", "ServiceState", "each", "model_info", "model_name"]
