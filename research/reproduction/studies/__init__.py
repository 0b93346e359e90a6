"""Measurements behind docs/reports/performance.md, docs/guide/jax.md and docs/guide/how_it_works.md.

Each module answers one question; run it as `python -m research.reproduction.studies.NAME`.
"""
