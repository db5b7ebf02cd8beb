"""HTTP scoring service (FastAPI). Imported by the CLI only."""
