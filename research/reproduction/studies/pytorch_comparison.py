"""keras_duq's penalty step against the paper code's step in PyTorch, same CPU.

The paper's FashionMNIST CNN with a DUQ head (256 centroid dimensions, 10
classes, two-sided penalty 0.05, SGD 0.05 with momentum 0.9 and weight decay
1e-4), batch 128 of random data. Each framework runs in its own worker
process, so that one's idle threads never compete with the other's step;
the parent asks them for `--steps` timed steps in turn, `--rounds` times,
alternating which goes first, and reports the median step time of each and
their ratio.

- keras_duq: `model.fit` on NumPy arrays, the time of each batch from
  `on_train_batch_begin` to `on_train_batch_end`.
- PyTorch: the paper code's step (`train_duq_fm.py` of the DUQ repository,
  re-implemented here from its description): `binary_cross_entropy` on the
  kernel values, the input gradient with `create_graph=True`, backward, SGD
  step, then the centroid update under `no_grad` in eval mode.

Needs `torch` (not a keras_duq dependency):

    pip install torch
    python -m research.reproduction.studies.pytorch_comparison --output research/reproduction/results/pytorch_comparison.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BATCH, CLASSES, FEATURES, CENTROID_DIMS = 128, 10, 256, 256
LENGTH_SCALE, GAMMA, PENALTY, LR, WEIGHT_DECAY = 0.1, 0.999, 0.05, 0.05, 1e-4


# ------------------------------------------------------------------ keras_duq


def keras_worker():

    import keras
    import numpy as np

    import keras_duq
    from research.reproduction import fashion_mnist

    keras.utils.set_random_seed(0)
    model = keras_duq.wrap(
        fashion_mnist.build_backbone(),
        CLASSES,
        centroid_dims=CENTROID_DIMS,
        length_scale=LENGTH_SCALE,
        momentum=GAMMA,
        gradient_penalty=PENALTY,
        weight_decay=WEIGHT_DECAY,
        projection_learning_rate=1.0,
        categorical_cross_entropy_weight=0.0,
    )
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9))

    class BatchTimes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    rng = np.random.default_rng(0)

    def run(steps):
        x = rng.normal(size=(steps * BATCH, 28, 28, 1)).astype("float32")
        y = rng.integers(0, CLASSES, size=len(x))
        timer = BatchTimes()
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[timer])
        return timer.times

    versions = {
        "tensorflow": __import__("tensorflow").__version__,
        "keras": keras.__version__,
    }
    return run, versions


# -------------------------------------------------------------------- PyTorch


def torch_worker():
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(1, 64, 3, padding=1), nn.BatchNorm2d(64)
            self.conv2, self.bn2 = nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128)
            self.conv3, self.bn3 = nn.Conv2d(128, 128, 3), nn.BatchNorm2d(128)
            self.fc1 = nn.Linear(2 * 2 * 128, FEATURES)
            self.W = nn.Parameter(
                torch.normal(torch.zeros(CENTROID_DIMS, CLASSES, FEATURES), 0.05)
            )
            self.register_buffer("N", torch.ones(CLASSES) * 12)
            self.register_buffer(
                "m", torch.normal(torch.zeros(CENTROID_DIMS, CLASSES), 1) * 12
            )

        def compute_features(self, x):
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
            x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
            x = F.max_pool2d(F.relu(self.bn3(self.conv3(x))), 2)
            return F.relu(self.fc1(x.flatten(1)))

        def embed(self, x):
            return torch.einsum("ij,mnj->imn", self.compute_features(x), self.W)

        def forward(self, x):
            z = self.embed(x)
            diff = z - (self.m / self.N).unsqueeze(0)
            return diff.pow(2).mean(1).div(-2 * LENGTH_SCALE**2).exp()

        def update_embeddings(self, x, y):
            z = self.embed(x)
            self.N = GAMMA * self.N + (1 - GAMMA) * y.sum(0)
            self.m = GAMMA * self.m + (1 - GAMMA) * torch.einsum("ijk,ik->jk", z, y)

    model = Model()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY
    )

    def step(x, labels):
        model.train()
        optimizer.zero_grad()
        x.requires_grad_(True)
        y_pred = model(x)
        y = F.one_hot(labels, CLASSES).float()
        loss = F.binary_cross_entropy(y_pred, y)
        gradients = torch.autograd.grad(
            y_pred, x, grad_outputs=torch.ones_like(y_pred), create_graph=True
        )[0].flatten(start_dim=1)
        loss = loss + PENALTY * ((gradients.norm(2, dim=1) - 1) ** 2).mean()
        loss.backward()
        optimizer.step()
        x.requires_grad_(False)
        with torch.no_grad():
            model.eval()
            model.update_embeddings(x, y)

    generator = torch.Generator().manual_seed(0)

    def run(steps):
        times = []
        for _ in range(steps):
            x = torch.randn(BATCH, 1, 28, 28, generator=generator)
            labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
            start = time.perf_counter()
            step(x, labels)
            times.append(time.perf_counter() - start)
        return times

    return run, {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}


# ---------------------------------------------------------------------- driver


def serve(kind):
    run, versions = {"keras": keras_worker, "torch": torch_worker}[kind]()
    run(5)  # warm-up: tracing, allocators
    print(json.dumps(versions), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(int(line))), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=None)
    parser.add_argument("--worker", choices=["keras", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return serve(args.worker)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    workers, versions = {}, {}
    for kind in ("keras", "torch"):
        workers[kind] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "research.reproduction.studies.pytorch_comparison",
                "--worker",
                kind,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        versions.update(json.loads(workers[kind].stdout.readline()))
    times = {kind: [] for kind in workers}
    for round_ in range(args.rounds):
        order = ("keras", "torch") if round_ % 2 == 0 else ("torch", "keras")
        for kind in order:
            workers[kind].stdin.write(f"{args.steps}\n")
            workers[kind].stdin.flush()
            times[kind].extend(json.loads(workers[kind].stdout.readline()))
    for worker in workers.values():
        worker.stdin.close()
        worker.wait()
    medians = {kind: 1000 * statistics.median(values) for kind, values in times.items()}
    report = {
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
        "batch_size": BATCH,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "median_step_ms": {k: round(v, 1) for k, v in medians.items()},
        "pytorch_over_keras_duq": round(medians["torch"] / medians["keras"], 3),
        "per_round_median_ms": {
            kind: [
                round(
                    1000
                    * statistics.median(values[i * args.steps : (i + 1) * args.steps]),
                    1,
                )
                for i in range(args.rounds)
            ]
            for kind, values in times.items()
        },
    }
    print(
        f"FashionMNIST CNN, DUQ with the two-sided penalty, batch {BATCH}, "
        f"{os.cpu_count()} cores, median of {args.rounds} x {args.steps} steps\n"
        f"  keras_duq (TensorFlow {versions['tensorflow']}, Keras {versions['keras']}): "
        f"{medians['keras']:.1f} ms/step\n"
        f"  paper's step (PyTorch {versions['torch']}, {versions['torch_threads']} threads): "
        f"{medians['torch']:.1f} ms/step\n"
        f"  PyTorch / keras_duq: {report['pytorch_over_keras_duq']:.2f}x"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
