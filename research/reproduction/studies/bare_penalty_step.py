"""A floor for the penalty step in TensorFlow: the paper's CNN step in bare TF ops.

The same computation as keras_duq's FashionMNIST penalty step (three
convolutions with batch statistics, max pooling, the 256-unit layer, the
DUQ head, BCE plus the two-sided penalty by double backprop, an SGD update),
written directly in TensorFlow ops: no Keras layers, no batch checks, no
finiteness guard, no centroid update. Batch normalization is computed five
ways (`--check` prints how far each one's weight gradients are from
`exact`'s):

- `exact`: mean and variance as keras_duq computes them in the penalty step
  (`second_order_moments` in `keras_duq/_tensorflow_trainer.py`), then `tf.nn.batch_normalization`;
- `stopgrad`: `tf.nn.moments`'s formula (variance around a stopped mean),
  which drops a second-order term;
- `fused`: `tf.compat.v1.nn.fused_batch_norm` (oneDNN's fused kernel);
- `xla_bn`: `exact`'s formula in a `tf.function(jit_compile=True)`, so XLA
  can fuse its element-wise operations while the convolutions stay oneDNN's;
- `custom_bn`: a `tf.custom_gradient` whose backward pass is the compact
  textbook formula (two reductions), recomputing the statistics from the
  input so that the second derivative stays exact.

A sixth, `jvp`, keeps `exact`'s batch norm but changes the order of
differentiation: reverse over forward instead of reverse over reverse. The
penalty's weight gradient is the weight gradient of the directional
derivative of `sum_c K_c` along d(penalty)/d(input gradient), held fixed; a
`tf.autodiff.ForwardAccumulator` gives that directional derivative and the
outer tape differentiates it. Exact, with a different operation graph.

    python -m research.reproduction.studies.bare_penalty_step             # all six, alternating
    python -m research.reproduction.studies.bare_penalty_step exact fused # only these
    python -m research.reproduction.studies.bare_penalty_step --profile   # `exact`'s time by op type
    python -m research.reproduction.studies.bare_penalty_step --check     # gradients vs `exact`

Each variant runs in its own process, in alternating rounds; the script
prints the median step time of each (milliseconds) and its ratio to `exact`.
`--profile` builds `exact`'s step as a TF1 graph (the same operations) and
prints where a step's time goes, summed by op type over three traced steps.
"""

import argparse
import collections
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("exact", "stopgrad", "fused", "xla_bn", "custom_bn", "jvp")
BATCH, EPSILON, LENGTH_SCALE, LAMBDA = 128, 1e-5, 0.1, 0.05

ROOT = Path(__file__).resolve().parents[3]


def build(tf, mode):
    """`(step, x, y, variables)`: the body of the bare penalty step with `mode`'s batch norm."""
    import numpy as np

    rng = np.random.default_rng(0)

    def variable(shape, scale=0.05):
        return tf.Variable(rng.normal(size=shape).astype("float32") * scale)

    convs = [
        (variable((3, 3, 1, 64)), variable((64,), 0)),
        (variable((3, 3, 64, 128)), variable((128,), 0)),
        (variable((3, 3, 128, 128)), variable((128,), 0)),
    ]
    norms = [
        (tf.Variable(tf.ones(c)), tf.Variable(tf.zeros(c))) for c in (64, 128, 128)
    ]
    dense = (variable((512, 256)), variable((256,), 0))
    projection = variable((256, 256 * 10))
    # As keras_duq initialises them; kernel values are then about 1e-5, not 0.
    centroids = tf.constant(rng.normal(size=(256, 10)).astype("float32") * 0.05)
    variables = [v for pair in convs + norms + [dense] for v in pair] + [projection]

    def moments(x):
        mean = tf.reduce_mean(x, [0, 1, 2], keepdims=True)
        variance = tf.reduce_mean(
            tf.math.squared_difference(x, mean), [0, 1, 2], keepdims=True
        )
        return mean, variance

    def exact(x, gamma, beta):
        mean, variance = moments(x)
        return tf.nn.batch_normalization(x, mean, variance, beta, gamma, EPSILON)

    compiled = tf.function(exact, jit_compile=True)

    @tf.custom_gradient
    def compact(x, gamma, beta):
        mean, variance = moments(x)
        scale = tf.math.rsqrt(variance + EPSILON)

        def gradient(upstream):
            # Recomputed from `x` (not captured) so the outer tape sees the
            # statistics as functions of `x`: the second derivative is exact.
            mean, variance = moments(x)
            scale = tf.math.rsqrt(variance + EPSILON)
            normalized = (x - mean) * scale
            count = tf.cast(tf.reduce_prod(tf.shape(x)[:3]), x.dtype)
            d_beta = tf.reduce_sum(upstream, [0, 1, 2])
            d_gamma = tf.reduce_sum(upstream * normalized, [0, 1, 2])
            d_x = gamma * scale * (upstream - (d_beta + normalized * d_gamma) / count)
            return d_x, d_gamma, d_beta

        return (x - mean) * (scale * gamma) + beta, gradient

    def batch_norm(x, gamma, beta):
        if mode == "fused":
            return tf.compat.v1.nn.fused_batch_norm(
                x, gamma, beta, epsilon=EPSILON, is_training=True
            )[0]
        if mode == "stopgrad":
            mean, variance = tf.nn.moments(x, [0, 1, 2], keepdims=True)
            return tf.nn.batch_normalization(x, mean, variance, beta, gamma, EPSILON)
        if mode in ("exact", "jvp"):
            return exact(x, gamma, beta)
        return {"xla_bn": compiled, "custom_bn": compact}[mode](x, gamma, beta)

    def kernel_values(x):
        for (kernel, bias), (gamma, beta), padding in zip(
            convs, norms, ("SAME", "SAME", "VALID")
        ):
            x = tf.nn.conv2d(x, kernel, 1, padding) + bias
            x = tf.nn.max_pool2d(tf.nn.relu(batch_norm(x, gamma, beta)), 2, 2, "VALID")
        x = tf.nn.relu(tf.reshape(x, (-1, 512)) @ dense[0] + dense[1])
        z = tf.reshape(x @ projection, (-1, 256, 10))
        return tf.exp(-tf.reduce_mean((z - centroids) ** 2, 1) / (2 * LENGTH_SCALE**2))

    def bce_of(y, kernels):
        return tf.reduce_mean(tf.keras.losses.binary_crossentropy(y, kernels))

    def penalty_of(gradient):
        norm = tf.sqrt(tf.reduce_sum(tf.reshape(gradient, (BATCH, -1)) ** 2, 1) + 1e-12)
        return LAMBDA * tf.reduce_mean((norm - 1) ** 2)

    def sgd(loss, gradients):
        return (
            loss,
            gradients,
            [v.assign_sub(0.001 * g) for v, g in zip(variables, gradients)],
        )

    def step(x, y):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                kernels = kernel_values(x)
                total = tf.reduce_sum(kernels)
            loss = bce_of(y, kernels) + penalty_of(inner.gradient(total, x))
        return sgd(loss, outer.gradient(loss, variables))

    def reverse_over_forward(x, y):
        with tf.GradientTape() as inner:
            inner.watch(x)
            total = tf.reduce_sum(kernel_values(x))
        gradient = inner.gradient(total, x)
        with tf.GradientTape() as penalty_tape:
            penalty_tape.watch(gradient)
            penalty = penalty_of(gradient)
        # With d(penalty)/d(gradient) held fixed, the penalty's weight
        # gradient is the weight gradient of the directional derivative along it.
        direction = penalty_tape.gradient(penalty, gradient)
        with tf.GradientTape() as outer:
            with tf.autodiff.ForwardAccumulator(x, direction) as forward:
                kernels = kernel_values(x)
                total = tf.reduce_sum(kernels)
            bce = bce_of(y, kernels)
            surrogate = bce + forward.jvp(total)
        return sgd(bce + penalty, outer.gradient(surrogate, variables))

    x = tf.constant(rng.normal(size=(BATCH, 28, 28, 1)).astype("float32"))
    y = tf.one_hot(rng.integers(0, 10, BATCH), 10)
    return (reverse_over_forward if mode == "jvp" else step), x, y, variables


def time_mode(mode, steps):
    import numpy as np
    import tensorflow as tf

    step, x, y, _ = build(tf, mode)
    compiled = tf.function(lambda x, y: step(x, y)[0])
    for _ in range(3):
        compiled(x, y)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        compiled(x, y).numpy()
        times.append(time.perf_counter() - start)
    print(f"{mode} {1000 * float(np.median(times)):.1f}")


def check():
    """Largest relative difference of each mode's weight gradients from `exact`'s."""
    import numpy as np
    import tensorflow as tf

    def gradients(mode):
        step, x, y, _ = build(tf, mode)
        # A convolution's bias feeds batch normalization, which removes it:
        # its exact gradient is zero and what it gets is rounding noise.
        # `variables` starts kernel, bias, kernel, bias, kernel, bias.
        return [g.numpy() for i, g in enumerate(step(x, y)[1]) if i not in (1, 3, 5)]

    reference = gradients("exact")
    for mode in MODES[1:]:
        worst = max(
            float(np.max(np.abs(g - r)) / np.max(np.abs(r)))
            for g, r in zip(gradients(mode), reference)
        )
        print(f"{mode:10s} max relative gradient difference from exact: {worst:.1e}")


def profile(traces=3):
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    step, x, y, _ = build(tf, "exact")
    _, _, updates = step(x, y)
    train = tf.group(*updates)
    session = tf.compat.v1.Session()
    session.run(tf.compat.v1.global_variables_initializer())
    for _ in range(3):
        session.run(train)
    by_type = collections.Counter()
    for _ in range(traces):
        metadata = tf.compat.v1.RunMetadata()
        session.run(
            train,
            options=tf.compat.v1.RunOptions(
                trace_level=tf.compat.v1.RunOptions.FULL_TRACE
            ),
            run_metadata=metadata,
        )
        for device in metadata.step_stats.dev_stats:
            for node in device.node_stats:
                label = node.timeline_label
                op = (
                    label.split(" = ")[1].split("(")[0]
                    if " = " in label
                    else node.node_name
                )
                by_type[op] += node.all_end_rel_micros / 1000 / traces
    total = sum(by_type.values())
    print(f"op time per step (sum over ops, ms): {total:.1f}")
    for op, ms in by_type.most_common(20):
        print(f"  {op:34s} {ms:7.1f} ms  {100 * ms / total:5.1f}%")
    groups = collections.Counter()
    for op, ms in by_type.items():
        group = next(
            (
                name
                for key, name in (
                    ("Conv2D", "convolutions"),
                    ("MaxPool", "max pooling"),
                    ("MatMul", "matrix products"),
                )
                if key in op
            ),
            "element-wise ops and reductions (batch norm's, ReLU's, the head's)",
        )
        groups[group] += ms
    for group, ms in groups.most_common():
        print(f"{group}: {ms:.1f} ms, {100 * ms / total:.1f}%")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", help=f"any of {', '.join(MODES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return time_mode(args.worker, args.steps)
    if args.profile:
        return profile()
    if args.check:
        return check()
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {MODES}")
    modes = args.modes or MODES
    results = collections.defaultdict(list)
    for _ in range(args.rounds):
        for mode in modes:
            output = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "research.reproduction.studies.bare_penalty_step",
                    "--worker",
                    mode,
                    "--steps",
                    str(args.steps),
                ],
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
            ).stdout.split()
            results[mode].append(float(output[-1]))
    for mode in modes:
        median = statistics.median(results[mode])
        ratio = (
            f"  {median / statistics.median(results['exact']):.2f}x exact"
            if "exact" in results
            else ""
        )
        print(
            f"{mode:10s} {median:7.1f} ms  (rounds: {', '.join(f'{t:.1f}' for t in results[mode])}){ratio}"
        )


if __name__ == "__main__":
    main()
