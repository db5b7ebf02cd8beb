"""One router per concern: ``score`` (the score routes, and their fast path past FastAPI's routing), ``models``,
``versions`` (the admin routes), ``updates`` (a line's threshold, updates from reviews), ``records``, ``lines``,
``health``, ``metrics``; ``deps``, what they depend on (the state, the settings, the keys).

May import: :mod:`padim.service.settings`, :mod:`padim.service.metrics`, :mod:`padim.service.edge`,
:mod:`padim.service.record`, :mod:`padim.service.updates`, :mod:`padim.service.state`, :mod:`padim.service.lines`.
"""
