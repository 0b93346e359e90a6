"""Records keras_duq's first training steps on the paper's CNN, for a
step-by-step comparison with a PyTorch version of the paper's training step
(`pytorch_steps.py`). See README.md in this folder.

Writes into the current folder: the initial weights (`initial_weights.npz`),
the batches (`batches.npz`), and per-step losses and weight snapshots for
`bce_epsilon` 0 (exact gradient) and 1e-12 (PyTorch's BCE gradient).
"""

import argparse

import keras
import numpy as np

import keras_duq
from research.reproduction import fashion_mnist

SNAPSHOT_STEPS = (1, 2, 5, 10, 20, 40)


def snapshot(model):
    return {v.path: np.array(v.numpy()) for v in model.variables}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    (x, y), _ = keras_duq.datasets.load_fashion_mnist()
    n = args.steps * args.batch_size
    x, y = keras_duq.datasets.normalize(x[:n]), y[:n].astype("int32")
    np.savez("batches.npz", x=x, y=y)
    initial = None
    for bce_epsilon in (0.0, 1e-12):
        keras.backend.clear_session()  # the same layer names in both models
        keras.utils.set_random_seed(0)
        settings = fashion_mnist.parse_args(["--bce-epsilon", str(bce_epsilon)])
        model = fashion_mnist.build_duq_model(settings, steps_per_epoch=468)
        model(x[:2], training=False)
        if initial is None:
            initial = snapshot(model)
            np.savez(
                "initial_weights.npz",
                **{k.replace("/", "|"): v for k, v in initial.items()},
            )
        for name, value in snapshot(model).items():
            np.testing.assert_array_equal(value, initial[name], err_msg=name)
        records, snapshots = [], {}
        for step in range(args.steps):
            batch = slice(step * args.batch_size, (step + 1) * args.batch_size)
            logs = model.train_on_batch(x[batch], y[batch], return_dict=True)
            model.reset_metrics()  # per-step values, not running means
            records.append({k: float(v) for k, v in logs.items()})
            if step + 1 in SNAPSHOT_STEPS:
                snapshots[step + 1] = snapshot(model)
        np.save(
            f"keras_eps{bce_epsilon:g}.npy",
            {"records": records, "snapshots": snapshots},
        )


if __name__ == "__main__":
    main()
