"""Measurements behind docs/performance.md, docs/jax.md and docs/how_it_works.md.

Each module answers one question; run it as `python -m reproduction.studies.NAME`.
"""
