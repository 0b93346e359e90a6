"""Benchmarks of keras_duq: `python -m research.benchmarks` prints the current speed table.

`research.benchmarks.speed` measures one Keras backend; `python -m research.benchmarks` runs
it on every backend installed and prints the table (docs/performance.md).
"""

from pathlib import Path

# Every benchmark's recorded results live in the one results tree, beside
# the reproduction's; scripts default to writing there.
RESULTS = (
    Path(__file__).resolve().parents[1] / "reproduction" / "results" / "benchmarks"
)
