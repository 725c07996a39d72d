"""Persistence and queries: parquet datasets (save/load) and DuckDB."""
