"""One service in several processes: API processes that speak HTTP and decode, one scoring process that owns the device.

``padim serve --workers N`` (``PADIM_WORKERS``) with N above 1 starts:

- the **supervisor** (:mod:`.supervisor`, the process ``padim serve`` runs in): binds the port once, makes the run
  folder, starts the others, replaces an API process that dies, restarts the scoring process when it dies after it was
  ready, and drains all of them on SIGTERM (API processes first, then the scoring process);
- one **scoring process** (:mod:`.scoring`): the models and their versions, the batchers and the device, the monitor,
  lines, update jobs and the record's upkeep. It serves the whole HTTP API on a Unix socket of the run folder, for the
  routes the API processes pass on, and takes pictures to score from the API processes on another;
- N **API processes** (:mod:`.api`), sharing the port: HTTP, limits and keys, decoding into shared memory, the verdict,
  heat maps, the JSON and the record's rows of their requests (a journal each). Every route but scoring and health is
  passed on to the scoring process.

They meet in the **run folder** (:mod:`.shared`, in ``/dev/shm``): the queue bound's counts, each process's state, the
table of served versions and what an API process needs of each (its view), and the slots pictures travel in.
Messages between them are small tuples (:mod:`.wire`); pictures and maps never travel in them.

Modules: ``supervisor``, ``scoring``, ``api``, ``shared``, ``wire``. Nothing outside imports this package but the
server (:mod:`padim.service.server`).

May import: :mod:`padim.service.settings`, :mod:`padim.service.metrics`, :mod:`padim.service.edge`,
:mod:`padim.service.record`, :mod:`padim.service.device`, :mod:`padim.service.state`, :mod:`padim.service.routes`,
:mod:`padim.service.app`.
"""
