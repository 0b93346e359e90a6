"""What reading the step's error code costs on the JAX backend, by how late it is read.

keras_duq's JAX step cannot raise inside `jit`: it returns an error code,
which the host reads after the call (`keras_duq/_jax_trainer.py`). Reading
a code waits for its step to finish, so the host cannot prepare the next
step meanwhile. This times `fit` of a small DUQ model with the penalty
(two dense layers, batch 64, 200 steps, steps of about half a millisecond
on a CPU, where host time matters most) with the code read after every
call, every 8 calls (`CHECK_EVERY`, the default) and only at the end of
the epoch, interleaved in one process:

    KERAS_BACKEND=jax python -m research.reproduction.studies.jax_error_check --output jax_error_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_duq  # noqa: E402
from keras_duq import _jax_trainer  # noqa: E402

EVERY = {"every call": 1, "every 8 calls (default)": 8, "at the epoch's end": 10**9}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    backbone = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(args.width, activation="relu"),
        ]
    )
    model = keras_duq.wrap(
        backbone,
        num_classes=2,
        length_scale=0.3,
        gradient_penalty=1.0,
        projection_learning_rate=1.0,
        categorical_cross_entropy_weight=0.0,
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * args.steps, 2)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model.fit(x[:640], y[:640], batch_size=64, epochs=1, verbose=0)  # compile

    times = {name: [] for name in EVERY}
    try:
        for _ in range(args.rounds):
            for name, every in EVERY.items():
                _jax_trainer.CHECK_EVERY = every
                start = time.perf_counter()
                model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False)
                times[name].append(1000 * (time.perf_counter() - start) / args.steps)
    finally:
        _jax_trainer.CHECK_EVERY = EVERY["every 8 calls (default)"]

    report = {
        "machine": {
            "platform": platform.platform(),
            "devices": [str(d) for d in jax.devices()],
            "jax": jax.__version__,
            "keras": keras.__version__,
        },
        "steps": args.steps,
        "ms_per_step_each_round": {
            k: [round(t, 4) for t in v] for k, v in times.items()
        },
        "median_ms_per_step": {
            k: round(statistics.median(v), 4) for k, v in times.items()
        },
    }
    every_call = report["median_ms_per_step"]["every call"]
    for name, median in report["median_ms_per_step"].items():
        print(f"{name:24s} {median:.3f} ms/step  {median / every_call:.2f}x every call")
    if args.output:
        with open(args.output, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
