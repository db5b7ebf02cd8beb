"""Alembic's environment: runs the migrations on the connection :func:`padim.service.record.store.migrate` hands it.

Alembic runs this file; imported as a module otherwise (the packaging test imports every module), it does nothing.
"""

from alembic import context


def run() -> None:
    connection = context.config.attributes["connection"]
    context.configure(connection=connection, target_metadata=None, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


try:
    context.config  # noqa: B018  # only inside a migration does alembic's context have a config
except (NameError, AttributeError):
    pass
else:
    run()
