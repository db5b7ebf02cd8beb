"""The HTTP edge: what every request meets before and after the application's routes.

- ``errors``: the one error family's answers (``{"error": {"code", "message"}}``), by the table of codes.
- ``schemas``: every response's shape (pydantic), as OpenAPI shows it.
- ``openapi``: the OpenAPI document made truthful (the real errors, raw image bodies, the key only when set).
- ``middleware``: request ids and logs, body limits and timeouts, metrics by route.
- ``protocol``: limits in front of the application (header size and count, slow or idle connections, too many).
- ``running``: how a uvicorn server of the service runs: JSON logs, the drain, a clean exit.

May import: :mod:`padim.service.metrics`.
"""
