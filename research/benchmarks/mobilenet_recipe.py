"""The bring_your_own_model notebook's recipe, over seeds: which optimizer trains it.

MobileNetV2 (alpha 0.35, from scratch, 32x32 RGB in [-1, 1]) under
`mixed_bfloat16`, its BatchNormalization momentum lowered to 0.9, wrapped with
`keras_duq.wrap(backbone, 10, momentum=0.99)` with the paper's loss
(`categorical_cross_entropy_weight=0`, unless `--wrap-json` says otherwise),
trained on the notebook's 6,000 FashionMNIST training images with batch 64 and
either SGD with momentum 0.9 and a cosine decay from 0.05 (`--optimizer sgd`)
or Adam at its default rate (`--optimizer adam`); `--head softmax` puts a
`Dense(10, "softmax")` on the same backbone instead, `--policy float32` trains
without mixed precision, `--penalty-start-epoch 2` trains the first epoch
without the gradient penalty, `--recompute-callback` re-estimates
BatchNormalization statistics after every epoch
(`keras_duq.callbacks.RecomputeBatchNormStatistics` on 2,000 training images).
The notebook reads PNG files through `tensorflow_datasets`; this reads the
same images as arrays. After each epoch: test accuracy on the notebook's 1,000
test images, training accuracy, median certainty and the AUROC of the
certainty against 1,000 MNIST test digits. One run per call, appended as one
JSON line to `--output`.

Example:

```bash
KERAS_HOME=../shared/data/keras python -m research.benchmarks.mobilenet_recipe \
    --optimizer adam --seed 0 --mnist-path ../shared/data/mnist \
    --output mobilenet_recipe.jsonl
```
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
from keras_duq import evaluation
from research.benchmarks.own_model_defaults import json_logs

NUM_TRAIN, NUM_TEST, BATCH_SIZE, IMAGE_SIZE = 6000, 1000, 64, 32


def prepare(images):
    """uint8 28x28 images as the notebook's pipeline gives them: 32x32x3 in [-1, 1]."""
    import tensorflow as tf

    x = tf.image.resize(images[..., None].astype("float32"), (IMAGE_SIZE, IMAGE_SIZE))
    return (tf.image.grayscale_to_rgb(x) / 127.5 - 1.0).numpy()


def build(optimizer, epochs, head="duq", wrap_kwargs=None, feature_layer="none"):
    backbone = keras.applications.MobileNetV2(
        input_shape=(IMAGE_SIZE, IMAGE_SIZE, 3),
        include_top=False,
        weights=None,
        pooling="avg",
        alpha=0.35,
    )
    for layer in backbone.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = 0.9
    if feature_layer == "batch_norm":
        backbone = keras.Sequential(
            [backbone, keras.layers.BatchNormalization(momentum=0.9)]
        )
    elif feature_layer == "layer_norm":
        backbone = keras.Sequential([backbone, keras.layers.LayerNormalization()])
    if optimizer == "sgd":
        steps = epochs * int(np.ceil(NUM_TRAIN / BATCH_SIZE))
        schedule = keras.optimizers.schedules.CosineDecay(0.05, decay_steps=steps)
        optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    else:
        optimizer = keras.optimizers.Adam()
    if head == "softmax":
        outputs = keras.layers.Dense(10, activation="softmax", dtype="float32")
        model = keras.Sequential([backbone, outputs])
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return model
    # The recipe's DUQ rows use the paper's loss; `--wrap-json
    # '{"categorical_cross_entropy_weight": 1.0}'` gives the library's default,
    # which the notebook and examples/bring_your_own_backbone.py use.
    recipe = {"momentum": 0.99, "categorical_cross_entropy_weight": 0.0}
    model = keras_duq.wrap(backbone, 10, **{**recipe, **(wrap_kwargs or {})})
    model.compile(optimizer=optimizer)
    return model


class DelayedPenalty(keras.callbacks.Callback):
    """Trains without the gradient penalty before epoch `start_epoch` (1-based)."""

    def __init__(self, start_epoch):
        super().__init__()
        self.start_epoch = start_epoch

    def on_train_begin(self, logs=None):
        self.weight = self.model.gradient_penalty

    def on_epoch_begin(self, epoch, logs=None):
        weight = self.weight if epoch + 1 >= self.start_epoch else 0.0
        if weight != self.model.gradient_penalty:
            # The weight is read when the step is traced: trace it again.
            self.model.gradient_penalty = weight
            self.model.make_train_function(force=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="adam")
    parser.add_argument("--head", choices=("duq", "softmax"), default="duq")
    parser.add_argument(
        "--wrap-json", default="{}", help="More `wrap` arguments, as JSON."
    )
    parser.add_argument(
        "--policy", choices=("mixed_bfloat16", "float32"), default="mixed_bfloat16"
    )
    parser.add_argument(
        "--feature-layer",
        choices=("none", "batch_norm", "layer_norm"),
        default="none",
        help="A normalisation layer appended to the backbone's pooled features.",
    )
    parser.add_argument(
        "--penalty-start-epoch",
        type=int,
        default=1,
        help="DUQ only: the first epoch (1-based) trained with the penalty.",
    )
    parser.add_argument(
        "--recompute-callback",
        action="store_true",
        help="DUQ only: re-estimate BatchNormalization statistics after every epoch.",
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mnist-path", default=None)
    parser.add_argument("--output", default="mobilenet_recipe.jsonl")
    args = parser.parse_args(argv)

    (x_train, y_train), (x_test, y_test) = datasets.load_fashion_mnist()
    x_ood, _ = datasets.load_mnist_test(args.mnist_path)
    x_train, y_train = prepare(x_train[:NUM_TRAIN]), y_train[:NUM_TRAIN]
    x_test, y_test = prepare(x_test[:NUM_TEST]), y_test[:NUM_TEST]
    x_ood = prepare(x_ood[:NUM_TEST])

    keras.mixed_precision.set_global_policy(args.policy)
    keras.utils.set_random_seed(args.seed)
    wrap_kwargs = json.loads(args.wrap_json)
    model = build(
        args.optimizer, args.epochs, args.head, wrap_kwargs, args.feature_layer
    )
    rows = []
    start = time.time()

    def measure(epoch, logs):
        scores = model.predict(x_test, batch_size=500, verbose=0)
        ood = model.predict(x_ood, batch_size=500, verbose=0)
        row = {
            "epoch": epoch + 1,
            "accuracy": float(np.mean(scores.argmax(1) == y_test)),
            "auroc": evaluation.ood_metrics(scores.max(1), ood.max(1))["auroc"],
            "median_certainty": float(np.median(scores.max(1))),
            "train_accuracy": float(logs["accuracy"]),
            "train_loss": float(logs["loss"]),
            "time_s": time.time() - start,
            "logs": json_logs(logs),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    callbacks = [keras.callbacks.LambdaCallback(on_epoch_end=measure)]
    if args.head == "duq":
        if args.penalty_start_epoch > 1:
            callbacks.append(DelayedPenalty(args.penalty_start_epoch))
        if args.recompute_callback:
            callbacks.append(
                keras_duq.callbacks.RecomputeBatchNormStatistics(x_train[:2000])
            )
    model.fit(
        x_train,
        y_train,
        batch_size=BATCH_SIZE,
        epochs=args.epochs,
        verbose=0,
        callbacks=callbacks,
    )
    record = {
        "head": args.head,
        "wrap_kwargs": wrap_kwargs,
        "policy": args.policy,
        "feature_layer": args.feature_layer,
        "penalty_start_epoch": args.penalty_start_epoch,
        "recompute_callback": args.recompute_callback,
        "optimizer": args.optimizer,
        "seed": args.seed,
        "keras_duq": keras_duq.__version__,
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "cpu": platform.processor() or platform.machine(),
        "epochs": rows,
    }
    with open(args.output, "a") as f:
        f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
