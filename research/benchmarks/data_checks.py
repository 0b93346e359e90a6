"""The cost of checking in-memory data before `fit`: FashionMNIST's 60,000 images.

`fit`, `evaluate` and `predict` check in-memory inputs and labels whole
before the first step (`keras_duq._validation.check_arrays`). This times
that check on the FashionMNIST training set as `uint8` (no finiteness pass:
integers are always finite) and standardised to float32, best of `--repeats`.

    KERAS_HOME=../shared/data/keras python -m research.benchmarks.data_checks
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import keras

from keras_duq import _validation
from keras_duq import datasets


def best_time(function, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    (x_uint8, y), _ = keras.datasets.fashion_mnist.load_data()
    x_float = datasets.normalize(x_uint8)  # with its channel axis
    spec = keras.Input((28, 28, 1))
    results = {}
    for name, x in (("uint8", x_uint8[..., None]), ("float32", x_float)):
        results[name] = best_time(
            lambda x=x: _validation.check_arrays("fit", spec, x, y, 10, "x"),
            args.repeats,
        )
    record = {
        "examples": len(y),
        "seconds_uint8": round(results["uint8"], 4),
        "seconds_float32": round(results["float32"], 4),
        "cpu": platform.processor() or platform.machine(),
        "keras": keras.__version__,
    }
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
