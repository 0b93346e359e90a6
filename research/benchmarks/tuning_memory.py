"""Process memory over many models trained in a loop, as the search does.

Each case runs in a fresh process: 16 models (a two-input MLP of two dense
layers of 32 units; 1500 points, 2 epochs, batch 64), each dropped and
garbage-collected before the next, with the resident memory (VmRSS) and the
number of those models still alive after each. Cases: DUQ, DUQ with
`keras.backend.clear_session()` before each model, a softmax model on the
same backbone, each on TensorFlow, and DUQ on JAX. Writes
research/reproduction/results/benchmarks/tuning_memory.json.

    python research/benchmarks/tuning_memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from research.benchmarks import RESULTS

NUM_MODELS = 16
CASES = (
    ("tensorflow", "duq"),
    ("tensorflow", "duq_clear_session"),
    ("tensorflow", "softmax"),
    ("jax", "duq"),
)


def resident_megabytes():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("No VmRSS in /proc/self/status (Linux only).")


def measure(case):
    """Runs in the child process: the memory after each model."""
    import gc
    import weakref

    import keras
    import numpy as np

    import keras_duq

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1500, 2)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    references, rows = [], []
    for index in range(NUM_MODELS):
        if case == "duq_clear_session":
            keras.backend.clear_session()
        backbone = keras.Sequential(
            [
                keras.Input((2,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(32),
            ]
        )
        if case == "softmax":
            model = keras.Sequential(
                [backbone, keras.layers.Dense(2, activation="softmax")]
            )
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        else:
            model = keras_duq.wrap(
                backbone,
                2,
                length_scale=0.3,
                gradient_penalty=0.1,
                projection_learning_rate=1.0,
                categorical_cross_entropy_weight=0.0,
            )
            model.compile(optimizer="adam")
        model.fit(x, y, epochs=2, batch_size=64, verbose=0)
        model.predict(x[:500], verbose=0)
        references.append(weakref.ref(model))
        del model, backbone
        gc.collect()
        rows.append(
            {
                "models": index + 1,
                "resident_mb": round(resident_megabytes(), 1),
                "alive": sum(reference() is not None for reference in references),
            }
        )
    return rows


def main():
    if len(sys.argv) == 2 and sys.argv[1].startswith("--child="):
        print(json.dumps(measure(sys.argv[1].split("=", 1)[1])))
        return
    results = []
    for backend, case in CASES:
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        output = subprocess.run(
            [sys.executable, __file__, f"--child={case}"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows = json.loads(output.strip().splitlines()[-1])
        # From the second model on: the first includes one-off start-up costs.
        growth = (rows[-1]["resident_mb"] - rows[0]["resident_mb"]) / (len(rows) - 1)
        results.append(
            {
                "backend": backend,
                "case": case,
                "mb_per_model": round(growth, 1),
                "rows": rows,
            }
        )
        print(
            f"{backend} {case}: {growth:.1f} MB per model, "
            f"{rows[-1]['alive']} of {NUM_MODELS} models alive"
        )
    path = RESULTS / "tuning_memory.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
