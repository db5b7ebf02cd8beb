"""Lines: pictures from a hot folder or a camera become verdicts at MQTT, a webhook or OPC UA, with nothing lost.

A *line* is one source (:mod:`.sources`), the served model that scores its pictures through the same micro-batcher
as ``POST /score``, and its sinks (:mod:`.sinks`). Its journal (:mod:`.journal`) gives each picture one verdict,
whatever restarts happen, and keeps each sink's outbox. :mod:`.config` reads ``lines.yaml``; :mod:`.pipeline`
runs the lines inside ``padim serve`` or ``padim watch``. May import :mod:`padim.service` and below; OpenCV, the
MQTT client and asyncua are optional extras, imported where a line uses them.
"""
