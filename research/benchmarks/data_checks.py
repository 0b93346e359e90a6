"""The cost of checking in-memory data before `fit`: FashionMNIST's 60,000 images.

`fit`, `evaluate` and `predict` check in-memory inputs and labels whole
before the first step. This times that check through `fit` itself: the
labels' last entry is out of range, so `fit` checks every image and label
and then refuses the call before any step. Timed on the FashionMNIST training
set as `uint8` (no finiteness pass: integers are always finite) and
standardised to float32, best of `--repeats`, beside the same refusal of a
single image (the call's fixed cost).

    KERAS_HOME=../shared/data/keras python -m research.benchmarks.data_checks
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import keras
import numpy as np

import keras_duq
from keras_duq import datasets


def best_time(function, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def refused(model, x, y):
    """Calls `fit`, which must refuse the labels after checking everything."""
    try:
        model.fit(x, y, epochs=1, verbose=0)
    except ValueError:
        return
    raise AssertionError("`fit` accepted an out-of-range label.")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    (x_uint8, y), _ = keras.datasets.fashion_mnist.load_data()
    x_float = datasets.normalize(x_uint8)  # with its channel axis
    model = keras_duq.wrap(
        keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten()]), 10
    )
    model.compile(optimizer="adam")
    y = np.array(y, "int64")
    y[-1] = 10  # out of range: found only after every other check passed
    results = {}
    for name, x in (("uint8", x_uint8[..., None]), ("float32", x_float)):
        results[name] = best_time(lambda x=x: refused(model, x, y), args.repeats)
    results["one"] = best_time(
        lambda: refused(model, x_float[-1:], y[-1:]), args.repeats
    )
    record = {
        "examples": len(y),
        "seconds_uint8": round(results["uint8"], 4),
        "seconds_float32": round(results["float32"], 4),
        "seconds_one_example": round(results["one"], 4),
        "cpu": platform.processor() or platform.machine(),
        "keras": keras.__version__,
    }
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
