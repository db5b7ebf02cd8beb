"""Lines: pictures from a hot folder or a camera become verdicts at MQTT, a webhook or OPC UA, with nothing lost.

A *line* is one source (``sources``; a camera's frames through ``capture``), the served model that scores its
pictures through the same micro-batcher as ``POST /score``, and its sinks (``sinks``). Its journal (``journal``) gives
each picture one verdict, whatever restarts happen, and keeps each sink's outbox (``outboxes``). ``config`` reads
``lines.yaml``; ``pipeline`` runs the lines inside ``padim serve`` or ``padim watch``. OpenCV, the MQTT client and
asyncua are optional extras, imported where a line uses them.

May import: :mod:`padim.service.metrics`, :mod:`padim.service.edge`, :mod:`padim.service.record`,
:mod:`padim.service.device`, :mod:`padim.service.state`.
"""
