"""Benchmarks of keras_duq: `python -m benchmarks` prints the current speed table.

`benchmarks.speed` measures one Keras backend; `python -m benchmarks` runs
it on every backend installed and prints the table (docs/performance.md).
"""
