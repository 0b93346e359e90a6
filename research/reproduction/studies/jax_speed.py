"""Training step time on Keras's JAX or PyTorch backend: softmax, DUQ and DUQ with the penalty.

Times `model.fit` steps at batch 128 on random data, side by side in one
run, for the paper's FashionMNIST CNN and the CIFAR-10 ResNet-18 (pick with
`--networks`), in float32 and `mixed_bfloat16`. Needs no TensorFlow (for GPU
machines with JAX or PyTorch only), and runs on a CPU too:

    KERAS_BACKEND=jax python -m research.reproduction.studies.jax_speed --output jax_speed.json
    KERAS_BACKEND=torch python -m research.reproduction.studies.jax_speed --output torch_speed.json
    KERAS_BACKEND=jax python -m research.reproduction.studies.jax_speed --networks cifar_resnet18 --steps 50

A step time is the wall time of one `fit` call of `--steps` steps divided by
the steps, after a compiling call; the median of `--repeats` calls. It
includes Keras's per-step overhead, as a user's `fit` does. Inference is
the median time of `predict_on_batch` on 1000 images. DUQ models are
built with `health_checks=False` unless `--health-checks` is given: the
checks add metrics to each step (research/benchmarks/health_overhead.py measures
them) and, for backbones with BatchNormalization, passes over a sample at
the end of an epoch and of `fit`, a cost per `fit` call that the short
`fit` calls here would spread over a few steps. `--output` is
rewritten after every model, so a run stopped early keeps what it measured.
On GPUs, set `--matmul-precision highest` to keep JAX (or PyTorch's
matmuls and cuDNN convolutions) from using TF32 in float32, for a
like-for-like comparison with a float32 run without TF32.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_duq  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
KINDS = ("softmax", "duq", "duq_penalty")


def _example(name):
    return importlib.import_module(f"research.reproduction.{name}")


def fashion_mnist_cnn():
    return _example("fashion_mnist").build_backbone(), (28, 28, 1), 256


def cifar_resnet18():
    if (
        "tensorflow" not in sys.modules
        and importlib.util.find_spec("tensorflow") is None
    ):
        # research/reproduction/cifar10.py imports TensorFlow for its tf.data pipeline;
        # its ResNet-18 is plain Keras, so a machine with JAX only can build it.
        sys.modules["tensorflow"] = types.ModuleType("tensorflow")
        try:
            module = _example("cifar10")
        finally:
            # Keras's data adapters look for TensorFlow in `sys.modules`.
            del sys.modules["tensorflow"]
    else:
        module = _example("cifar10")
    return module.build_resnet18(), (32, 32, 3), 512


NETWORKS = {"fashion_mnist_cnn": fashion_mnist_cnn, "cifar_resnet18": cifar_resnet18}


def build(kind, make_backbone, health_checks=False):
    backbone, shape, centroid_dims = make_backbone()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    if kind == "softmax":
        model = keras.Sequential(
            [backbone, keras.layers.Dense(10, activation="softmax")]
        )
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    else:
        model = keras_duq.wrap(
            backbone,
            num_classes=10,
            centroid_dims=centroid_dims,
            length_scale=0.1,
            gradient_penalty=0.5 if kind == "duq_penalty" else 0.0,
            health_checks=health_checks,
            projection_learning_rate=1.0,
            categorical_cross_entropy_weight=0.0,
        )
        model.compile(optimizer=optimizer)
    return model, shape


def block_until_ready(value):
    """Waits for the device: GPU calls return before their work is done."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.block_until_ready(value)
    if keras.backend.backend() == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return value


def set_matmul_precision(precision):
    if keras.backend.backend() == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision", precision)
    elif keras.backend.backend() == "torch":
        import torch

        tf32 = precision != "highest"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def devices():
    if keras.backend.backend() == "jax":
        import jax

        return [str(d) for d in jax.devices()], {"jax": jax.__version__}
    if keras.backend.backend() == "torch":
        import torch

        names = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
        return names or ["cpu"], {"torch": torch.__version__}
    return [keras.backend.backend()], {}


def time_steps(model, shape, batch_size, steps, repeats):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size * steps,) + shape).astype("float32")
    y = rng.integers(0, 10, size=batch_size * steps)
    start = time.perf_counter()
    model.fit(
        x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0
    )  # compile
    first_fit_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        for variable in model.trainable_variables[:1]:
            block_until_ready(variable.value)
        times.append((time.perf_counter() - start) / steps * 1000.0)
    return statistics.median(times), times, first_fit_s


def time_inference(model, shape, batch_size=1000, repeats=5):
    """Median ms of `predict_on_batch` on one batch of `batch_size`, after a compiling call."""
    x = np.random.default_rng(1).normal(size=(batch_size,) + shape).astype("float32")
    block_until_ready(model.predict_on_batch(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        block_until_ready(model.predict_on_batch(x))
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--networks", nargs="+", default=["fashion_mnist_cnn"], choices=sorted(NETWORKS)
    )
    parser.add_argument("--policies", nargs="+", default=["float32", "mixed_bfloat16"])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument(
        "--matmul-precision", default=None, choices=(None, "highest", "default")
    )
    parser.add_argument(
        "--health-checks",
        action="store_true",
        help="Build the DUQ models with their health checks (see the docstring).",
    )
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if args.matmul_precision:
        set_matmul_precision(args.matmul_precision)
    names, versions = devices()
    report = {
        "backend": keras.backend.backend(),
        "devices": names,
        "machine": platform.processor() or platform.machine(),
        **versions,
        "keras": keras.__version__,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "matmul_precision": args.matmul_precision,
        "health_checks": args.health_checks,
        "ms_per_step": {},
    }
    for network in args.networks:
        make_backbone = NETWORKS[network]
        for policy in args.policies:
            keras.mixed_precision.set_global_policy(policy)
            row = report["ms_per_step"][f"{network}/{policy}"] = {}
            for kind in args.kinds:
                keras.utils.set_random_seed(0)
                model, shape = build(kind, make_backbone, args.health_checks)
                median, times, first_fit_s = time_steps(
                    model, shape, args.batch_size, args.steps, args.repeats
                )
                row[kind] = {
                    "median": round(median, 3),
                    "all": [round(t, 3) for t in times],
                    "first_fit_s": round(first_fit_s, 1),  # mostly compilation
                }
                if kind != "duq_penalty":  # the same network as "duq" at inference
                    row[kind]["predict_b1000_ms"] = round(
                        time_inference(model, shape), 3
                    )
                print(
                    f"{network} {policy} {kind}: {median:.2f} ms/step, {row[kind]}",
                    flush=True,
                )
                write(report, args.output)
            if "duq_penalty" in row and "softmax" in row:
                row["penalty_over_softmax"] = round(
                    row["duq_penalty"]["median"] / row["softmax"]["median"], 3
                )
            write(report, args.output)
            keras.mixed_precision.set_global_policy("float32")
    print(json.dumps(report, indent=1))


def write(report, output):
    if output:
        Path(output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
