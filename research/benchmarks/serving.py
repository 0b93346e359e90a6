"""Serving latency and file size of each export format, in its own runtime.

For each backend (one subprocess each, `KERAS_BACKEND` set), builds the
paper's FashionMNIST CNN with a 10-class DUQ head, trains it for three epochs
on 2,048 FashionMNIST training images (so that certainties are those of a
model that has learned something), exports it with `certainty_threshold`
and a `calibrator` to every format that backend writes (`FORMATS`, as
docs/guide/serving.md lists them), loads each export in its runtime and times one request
at batch 1 and at batch 256 (FashionMNIST test images), beside
`model.predict` and a direct `model(x)` call in the same process. A time is the median
seconds per call over `--windows` interleaved windows after warm-up
(`research.benchmarks.speed.interleaved_seconds`). Also reported: the size on disk
of each export, and the largest absolute difference of its `certainty`
from `predict`'s.

    KERAS_HOME=../shared/data/keras python -m research.benchmarks.serving \
        --output research/reproduction/results/benchmarks/serving.json
    python -m research.benchmarks.serving --backends tensorflow --windows 3   # quicker

Needs the `export` extra (`pip install -e ".[export]"`) and the backends
it runs; PyTorch's LiteRT row also needs `litert-torch`, in an environment
of its own (docs/guide/serving.md says why): run the benchmark from there, e.g. a
virtual environment made with `--system-site-packages` on top of the
`export` one. Runtimes use their default threads; OpenVINO is compiled with
`INFERENCE_PRECISION_HINT: f32` (otherwise it may compute in bfloat16).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("tensorflow", "jax", "torch")
BATCH_SIZES = (1, 256)
# The formats each backend writes (docs/guide/serving.md's table).
FORMATS = {
    "tensorflow": ("tf_saved_model", "onnx", "litert", "openvino"),
    "jax": ("tf_saved_model", "onnx", "openvino"),
    "torch": ("onnx", "openvino", "torch", "litert"),
}
_SUFFIX = {
    "tf_saved_model": "",
    "onnx": ".onnx",
    "litert": ".tflite",
    "openvino": ".xml",
    "torch": ".pt2",
}


def _runtime(format, path):
    """A callable `x -> dict of numpy outputs` that serves the export at `path`."""
    if format == "tf_saved_model":
        import tensorflow as tf

        serve = tf.saved_model.load(path).signatures["serving_default"]
        return lambda x: {k: v.numpy() for k, v in serve(inputs=tf.constant(x)).items()}
    if format == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(path)
        names = [output.name for output in session.get_outputs()]
        return lambda x: dict(zip(names, session.run(None, {"inputs": x})))
    if format == "litert":
        from ai_edge_litert.interpreter import Interpreter

        # One runner per batch size: resizing the input reallocates tensors.
        runners = {}

        def serve(x):
            if len(x) not in runners:
                runners[len(x)] = Interpreter(model_path=path).get_signature_runner()
            return runners[len(x)](inputs=x)

        return serve
    if format == "openvino":
        import openvino

        compiled = openvino.Core().compile_model(
            path, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
        )
        request = compiled.create_infer_request()

        def serve(x):
            results = request.infer(x)
            return {o.get_any_name(): results[o] for o in compiled.outputs}

        return serve
    import torch

    module = torch.export.load(path).module()

    def serve(x):
        with torch.no_grad():
            return {k: v.numpy() for k, v in module(torch.from_numpy(x)).items()}

    return serve


def _size_mb(path):
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    if path.suffix == ".xml":  # OpenVINO: the graph and its weights
        files.append(path.with_suffix(".bin"))
    return sum(p.stat().st_size for p in files) / 2**20


def measure(windows):
    """This process's backend: a dict of records, one per way of serving."""
    import keras
    import numpy as np

    from keras_duq.evaluation import CertaintyCalibrator
    from research.benchmarks.speed import build
    from research.benchmarks.speed import interleaved_seconds

    backend = keras.backend.backend()
    model = build("duq_penalty", "fashion_mnist_cnn")
    (x_train, y_train), (x_test, y_test) = keras.datasets.fashion_mnist.load_data()
    x_train = (x_train[:2048, ..., None] / 255.0).astype("float32")
    model.fit(x_train, y_train[:2048], batch_size=64, epochs=3, verbose=0)
    x_test = (x_test[:256, ..., None] / 255.0).astype("float32")
    inputs = {size: x_test[:size] for size in BATCH_SIZES}
    kernel_values = model.predict(inputs[256], verbose=0)
    certainty = kernel_values.max(axis=1)
    correct = kernel_values.argmax(axis=1) == y_test[:256]
    calibrator = CertaintyCalibrator().fit(certainty, correct)
    threshold = float(np.median(certainty))

    def direct(x):
        return keras.ops.convert_to_numpy(model(x, training=False))

    servers = {
        "model.predict": lambda x: model.predict(x, verbose=0, batch_size=len(x)),
        "model(x)": direct,
    }
    sizes, differences, errors = {}, {}, {}
    folder = tempfile.mkdtemp()
    for format in FORMATS[backend]:
        # A LiteRT file from PyTorch has a fixed batch size: one per size.
        fixed = format == "litert" and backend == "torch"
        paths = {
            size: os.path.join(folder, f"duq_{size}" + _SUFFIX[format])
            for size in (BATCH_SIZES if fixed else (None,))
        }
        try:
            for size, path in paths.items():
                signature = None
                if size is not None:
                    shape = (size,) + x_test.shape[1:]
                    signature = [keras.InputSpec(shape=shape, name="inputs")]
                model.export(
                    path,
                    format=format,
                    input_signature=signature,
                    certainty_threshold=threshold,
                    calibrator=calibrator,
                )
        except Exception as error:  # reported, not timed
            errors[format] = f"export: {type(error).__name__}: {str(error)[-300:]}"
            continue
        sizes[format] = _size_mb(path)
        try:
            runtimes = {size: _runtime(format, path) for size, path in paths.items()}
            if fixed:

                def serve(x, runtimes=runtimes):
                    return runtimes[len(x)](x)

            else:
                serve = runtimes[None]
            served = serve(inputs[256])["certainty"]
        except Exception as error:  # reported, not timed
            errors[format] = f"runtime: {type(error).__name__}: {str(error)[:300]}"
            continue
        servers[format] = serve
        differences[format] = float(np.max(np.abs(served - certainty)))
    records = []
    for size in BATCH_SIZES:
        x = inputs[size]
        times = interleaved_seconds(
            {name: (lambda serve=serve: serve(x)) for name, serve in servers.items()},
            warmup=3,
            windows=windows,
            calls_per_window=1,
            min_window_s=0.3,
        )
        for name, seconds in times.items():
            records.append(
                {
                    "backend": backend,
                    "runtime": name,
                    "batch_size": size,
                    "ms_per_request": 1000 * statistics.median(seconds),
                    "size_mb": sizes.get(name),
                    "max_certainty_difference": differences.get(name),
                }
            )
    for name, error in errors.items():
        records.append(
            {
                "backend": backend,
                "runtime": name,
                "size_mb": sizes.get(name),
                "error": error,
            }
        )
    return records


def _versions():
    versions = {}
    for name in (
        "keras",
        "tensorflow",
        "jax",
        "torch",
        "onnxruntime",
        "openvino",
        "ai_edge_litert",
        "tf2onnx",
        "jax2onnx",
        "onnx",
        "litert_torch",
    ):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            from importlib.metadata import version

            versions[name] = version(name.replace("_", "-"))
        except Exception:  # a module whose distribution has another name
            versions[name] = "installed"
    return versions


def table(records):
    """The Markdown table of `docs/guide/serving.md`."""
    lines = [
        "| backend | served by | ms, batch 1 | ms, batch 256 | size (MB) "
        "| max certainty difference from predict |",
        "|---|---|---|---|---|---|",
    ]
    keys = []
    for record in records:
        key = (record["backend"], record["runtime"])
        if key not in keys:
            keys.append(key)
    for backend, runtime in keys:
        by_size = {
            r["batch_size"]: r
            for r in records
            if r["backend"] == backend and r["runtime"] == runtime and "error" not in r
        }
        if not by_size:  # the runtime could not serve the export
            (failed,) = [
                r
                for r in records
                if r["backend"] == backend and r["runtime"] == runtime
            ]
            stage = failed["error"].split(":")[0]  # "export" or "runtime"
            size = "" if failed["size_mb"] is None else f"{failed['size_mb']:.1f}"
            what = "fails to export" if stage == "export" else "fails to run"
            lines.append(f"| {backend} | {runtime} | {what} | | {size} | |")
            continue
        first = by_size[BATCH_SIZES[0]]
        size = "" if first["size_mb"] is None else f"{first['size_mb']:.1f}"
        difference = first["max_certainty_difference"]
        difference = "" if difference is None else f"{difference:.1e}"
        lines.append(
            f"| {backend} | {runtime} | {by_size[1]['ms_per_request']:.2f} "
            f"| {by_size[256]['ms_per_request']:.1f} | {size} | {difference} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS
    )
    parser.add_argument("--windows", type=int, default=7)
    parser.add_argument("--output", default=None, help="JSON file to write.")
    parser.add_argument("--_one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._one:  # a child process: its backend
        print(json.dumps(measure(args.windows)), flush=True)
        return
    records = []
    for backend in args.backends:
        if importlib.util.find_spec(backend) is None:
            print(f"{backend}: not installed, skipped", flush=True)
            continue
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "research.benchmarks.serving",
                "--_one",
                f"--windows={args.windows}",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"},
        )
        if result.returncode != 0:
            raise RuntimeError(f"{backend}: {result.stderr[-3000:]}")
        records.extend(json.loads(result.stdout.strip().splitlines()[-1]))
    print(table(records))
    report = {
        "command": "python -m research.benchmarks.serving "
        + " ".join(argv or sys.argv[1:]),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": _versions(),
        "records": records,
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
