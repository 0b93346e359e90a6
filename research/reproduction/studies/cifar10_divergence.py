"""Where CIFAR-10 training with keras_duq's defaults goes non-finite: per-step logs.

The CIFAR-10 problem of `research.benchmarks.recipe` (its ResNet-20-like backbone,
per-channel standardisation, SGD 0.05 with momentum 0.9 and a cosine decay,
batch 128) on a smaller draw (`--per-class` images of each class, default
200), for `--epochs` epochs. After every step it prints one JSON line: the
step's logs, the norm of `W`, the mean norm of the backbone's inference-mode
features on 256 training images (what the centroid update computes) and the
mean centroid norm. A run that stops on a non-finite update says so.

    python -m research.reproduction.studies.cifar10_divergence                      # the defaults
    python -m research.reproduction.studies.cifar10_divergence --clipnorm 1.0
    python -m research.reproduction.studies.cifar10_divergence \\
        --wrap-json '{"projection_learning_rate": 1.0}'

The table in docs/reports/beyond_fashion_mnist.md ("Why CIFAR-10 diverges with the
defaults") comes from these three runs, seed 0.
"""

from __future__ import annotations

import argparse
import json

import keras
import numpy as np

import keras_duq
from research.benchmarks import recipe
from research.reproduction import shared_data


class StepLog(keras.callbacks.Callback):
    """Prints each step's logs with the norms behind the divergence."""

    def __init__(self, backbone, probe):
        super().__init__()
        self.backbone = backbone
        self.probe = probe
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        layer = self.model.duq_output
        features = keras.ops.convert_to_numpy(self.backbone(self.probe, training=False))
        row = {key: round(float(value), 4) for key, value in (logs or {}).items()}
        row.update(
            step=self.step,
            projection_norm=float(
                np.linalg.norm(keras.ops.convert_to_numpy(layer.projection))
            ),
            feature_norm=float(np.linalg.norm(features, axis=1).mean()),
            centroid_norm=float(
                np.linalg.norm(
                    keras.ops.convert_to_numpy(layer.centroids), axis=0
                ).mean()
            ),
        )
        print(json.dumps(row), flush=True)
        self.step += 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-class", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--clipnorm", type=float, default=None)
    parser.add_argument("--wrap-json", default="{}", help="`wrap` arguments as JSON.")
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    train, _ = shared_data.cifar10()
    x, y = recipe._subset(*train, args.per_class, args.seed)
    (x,) = recipe._standardize(x)
    backbone = recipe.small_resnet(x.shape[1:])
    model = keras_duq.wrap(backbone, 10, **json.loads(args.wrap_json))
    steps = args.epochs * -(-len(x) // 128)
    model.compile(
        optimizer=keras.optimizers.SGD(
            keras.optimizers.schedules.CosineDecay(0.05, steps),
            momentum=0.9,
            clipnorm=args.clipnorm,
        )
    )
    try:
        model.fit(
            x,
            y,
            epochs=args.epochs,
            batch_size=128,
            verbose=0,
            callbacks=[StepLog(backbone, x[:256])],
        )
        print("trained")
    except ValueError as error:
        if "non-finite" not in str(error):
            raise
        print("stopped: non-finite update")


if __name__ == "__main__":
    main()
