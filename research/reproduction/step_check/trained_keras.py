"""keras_duq's loss and penalty gradients at trained weights, for a comparison
with the paper's step in PyTorch (`trained_pytorch.py`). See README.md here.

The first-steps check (`keras_steps.py`) starts from initial weights, where
every kernel value is tiny, the input gradient is near zero and the penalty's
gradient is too small to test. Here the weights are those of the committed
`duq_seed0` run after 30 epochs, where the penalty is about 0.03 and its
gradient, times the weight 0.05, is 0.35-1.5 times the cross-entropy's,
layer by layer.

Usage, from this folder (writes `trained_weights.npz` and
`trained_keras_{float32,float64}[_tf_nn_moments].npy`):

    python trained_keras.py float64
    python trained_keras.py float64 --tf-nn-moments   # without keras_duq's fix
"""

import argparse
import contextlib
import os

import keras
import numpy as np
import tensorflow as tf

import keras_duq
from keras_duq import _ops
from keras_duq import _tensorflow_trainer
from research.reproduction import fashion_mnist

STATE = os.path.join(
    os.path.dirname(__file__),
    "..",
    "results",
    "fashion_mnist",
    "duq_seed0",
    "backup",
    "member_0",
    "state",
    "latest.weights.h5",
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dtype", choices=("float32", "float64"))
    parser.add_argument(
        "--tf-nn-moments",
        action="store_true",
        help="differentiate BatchNorm with tf.nn.moments (keras_duq before its fix)",
    )
    args = parser.parse_args()
    if args.tf_nn_moments:
        _tensorflow_trainer.second_order_moments = contextlib.nullcontext
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    keras.config.set_floatx(args.dtype)
    model = fashion_mnist.build_duq_model(fashion_mnist.parse_args([]), 469)
    (x, y), _ = keras_duq.datasets.load_fashion_mnist()
    x, y = (
        keras_duq.datasets.normalize(x[:128]).astype(args.dtype),
        y[:128].astype("int32"),
    )
    model(x[:2], training=False)
    model.load_weights(STATE)  # warns that it skips the optimizer: not needed here
    np.savez(
        "trained_weights.npz",
        x=x.astype("float32"),
        y=y,
        **{
            v.path.replace("/", "|"): v.numpy().astype("float32")
            for v in model.variables
        },
    )
    with tf.GradientTape(persistent=True) as tape:
        log_kernel, penalty = model._log_kernel_and_penalty(
            tf.constant(x), training=True
        )
        bce = tf.reduce_mean(
            _ops.binary_cross_entropy(log_kernel, tf.one_hot(y, 10), 0.0)
        )
        penalty = tf.reduce_mean(penalty)
    result = {
        "bce": float(bce),
        "penalty": float(penalty),
        "log_kernel": log_kernel.numpy(),
    }
    for name, loss in (("bce", bce), ("penalty", penalty)):
        gradients = tape.gradient(loss, model.trainable_weights)
        for variable, gradient in zip(model.trainable_weights, gradients):
            result[f"{name}|{variable.path}"] = gradient.numpy()
    suffix = "_tf_nn_moments" if args.tf_nn_moments else ""
    np.save(f"trained_keras_{args.dtype}{suffix}.npy", result)
    print(
        f"{args.dtype}{suffix}: bce {result['bce']:.8f}, penalty {result['penalty']:.8f}"
    )


if __name__ == "__main__":
    main()
