"""The inspection record: every verdict kept, with the picture as it was sent, for review and for learning.

- :mod:`.tables`: the schema (SQLAlchemy 2), one for SQLite and PostgreSQL; :mod:`.migrations` takes a database
  from any earlier schema to this one (Alembic).
- :mod:`.journal`: the bounded on-disk journal rows wait in until the database has them (fsynced, replayed).
- :mod:`.pictures`: the pictures' bytes as sent, addressed by their sha256, under a byte budget and retention.
- :mod:`.store`: the database's side (rows, reviews, jobs, what pictures hold), behind one class.
- :mod:`.recorder`: the two writer threads that take rows from scoring to the journal and on to the database,
  so that scoring never waits for the database.
- :mod:`.export`: a filtered set of rows and pictures written to a folder (``padim records export``).

- ``rows``: a row from what a score answered, with the client's fields; ``jobs``: update jobs, run once across
  replicas; ``upkeep``: stopped replicas' journals adopted, pictures evicted past retention or the byte budget.

This package imports SQLAlchemy and Alembic, and from padim only ``padim.models.errors`` and the repository's
``sync_directory``.

May import: nothing of :mod:`padim.service`.
"""
