"""The tables scripts/docs_tables.py writes into the docs, a module per family of benchmarks."""
