"""`length_scale="auto"`'s factor against the fixed 0.1, on the recipe's problems.

Each run is `research.benchmarks.recipe.run` with the library's defaults, but
`length_scale=0.1` (the paper's value, with the centroids' random start at
N(0, 1)) for `fixed`, or `"auto"` with the length scale set to `factor` times
the features' spread (`keras_duq._duq_output.AUTO_LENGTH_SCALE_SPREADS`; the
library's is 0.5):

    python -m research.benchmarks.length_scale_start --problems small_data wine \\
        --seeds 0 1 --variants fixed 0.5 1.0 2.0 --output sweep.jsonl

Records are JSON lines (`label`: `fixed` or `auto x<factor>`), summarised with
`python -m research.benchmarks.recipe --summarize sweep.jsonl`.
"""

from __future__ import annotations

import argparse

from keras_duq import _duq_output
from research.benchmarks import recipe


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=["small_data", "wine"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--variants", nargs="+", default=["fixed", "0.5", "1.0", "2.0"])
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    default = _duq_output.AUTO_LENGTH_SCALE_SPREADS
    for problem in args.problems:
        for seed in args.seeds:
            for variant in args.variants:
                if variant == "fixed":
                    overrides, label = {"length_scale": 0.1}, "fixed"
                else:
                    overrides, label = {"length_scale": "auto"}, f"auto x{variant}"
                    _duq_output.AUTO_LENGTH_SCALE_SPREADS = float(variant)
                try:
                    record = recipe.run(problem, seed, "duq", overrides)
                finally:
                    _duq_output.AUTO_LENGTH_SCALE_SPREADS = default
                record["label"] = label
                recipe.emit(record, args.output)


if __name__ == "__main__":
    main()
