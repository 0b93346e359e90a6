"""The speed of keras_duq against a softmax model, on every Keras backend installed.

    python -m research.benchmarks                      # a few minutes on a laptop CPU
    python -m research.benchmarks --quick              # a smoke run, seconds per backend
    python -m research.benchmarks --backends jax --output speed.json

Runs `research.benchmarks.speed` in one subprocess per backend (TensorFlow, JAX,
PyTorch; `KERAS_BACKEND` set for each), skipping a backend that is not
installed, and prints one table: milliseconds per training step of a softmax
model, of DUQ without and with the gradient penalty, and per inference batch,
each with its ratio to the softmax model on the same backend. The ratios are
the numbers to compare across machines; absolute times depend on the
hardware, which the JSON (`--output`) records.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from research.benchmarks.speed import NETWORKS
from research.benchmarks.speed import PREDICT_KINDS
from research.benchmarks.speed import TRAIN_KINDS

ROOT = Path(__file__).resolve().parents[2]
# Backend name -> the module it needs.
BACKENDS = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}
LABELS = {
    "softmax": "softmax",
    "duq": "DUQ, no penalty",
    "duq_penalty": "DUQ with penalty",
}
PREDICT_LABELS = {"softmax": "softmax", "duq": "DUQ"}


def run_backend(backend: str, networks, quick: bool) -> dict:
    """`research.benchmarks.speed` in a subprocess with `KERAS_BACKEND=backend`.

    Returns its report, or `{"skipped": reason}` when the backend is not
    installed or the run fails.
    """
    if importlib.util.find_spec(BACKENDS[backend]) is None:
        return {"skipped": f"not installed (`pip install {BACKENDS[backend]}`)"}
    env = dict(os.environ, KERAS_BACKEND=backend)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "speed.json"
        command = [
            sys.executable,
            "-m",
            "research.benchmarks.speed",
            "--output",
            str(output),
        ]
        command += ["--networks", *networks] + (["--quick"] if quick else [])
        process = subprocess.run(
            command, env=env, cwd=ROOT, capture_output=True, text=True
        )
        if process.returncode != 0:
            # The exception's last line says why (keras_duq names the
            # backends it trains on, for example).
            last = (process.stderr.strip().splitlines() or ["no output"])[-1]
            return {"skipped": f"failed: {last}"}
        return json.loads(output.read_text())


def table(reports: dict) -> str:
    """One row per backend, network and measurement: ms and ratio to softmax."""
    header = ("backend", "network", "measurement", "ms", "x softmax")
    rows, notes = [], []
    for backend, report in reports.items():
        if "skipped" in report:
            notes.append(f"{backend} skipped: {report['skipped']}")
            continue
        for network, result in report["networks"].items():
            train, predict = result["train_ms"], result["predict_ms"]
            for kind in TRAIN_KINDS:
                rows.append(
                    (
                        backend,
                        network,
                        f"train step, batch {result['batch_size']}: {LABELS[kind]}",
                        f"{train[kind]:.2f}",
                        f"{train[kind] / train['softmax']:.2f}",
                    )
                )
            for kind in PREDICT_KINDS:
                rows.append(
                    (
                        backend,
                        network,
                        f"inference, batch {result['predict_batch_size']}: "
                        f"{PREDICT_LABELS[kind]}",
                        f"{predict[kind]:.2f}",
                        f"{predict[kind] / predict['softmax']:.2f}",
                    )
                )
    widths = [
        max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))
    ]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in [header, tuple("-" * width for width in widths), *rows]
    ]
    return "\n".join(lines + notes)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument(
        "--backends", nargs="+", choices=sorted(BACKENDS), default=list(BACKENDS)
    )
    parser.add_argument(
        "--networks", nargs="+", choices=sorted(NETWORKS), default=sorted(NETWORKS)
    )
    parser.add_argument(
        "--quick", action="store_true", help="A smoke run: few, short windows."
    )
    parser.add_argument(
        "--output", help="Also write every backend's report as JSON here."
    )
    args = parser.parse_args(argv)
    reports = {}
    for backend in args.backends:
        print(f"measuring on {backend} ...", file=sys.stderr, flush=True)
        reports[backend] = run_backend(backend, args.networks, args.quick)
    print(table(reports))
    for backend, report in reports.items():
        if "machine" in report:
            machine = report["machine"]
            print(
                f"{backend}: {machine['backend_version']}, Keras {machine['keras']}, "
                f"{machine['processor']} ({machine['cpus']} CPUs), "
                f"devices {machine['devices']}"
            )
    if args.output:
        Path(args.output).write_text(json.dumps(reports, indent=1) + "\n")
        print(f"wrote {args.output}")
    return reports


if __name__ == "__main__":
    main()
