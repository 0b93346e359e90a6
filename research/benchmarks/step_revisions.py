"""A training step's cost at two revisions of keras_duq, side by side.

Runs `research.benchmarks.head_cost` (each DUQ step timed against a softmax
step in the same process) alternately in a checkout of `--base` and in this
working tree, on the same networks, `--rounds` times each, and prints each
run's step time and ratio to softmax, then the medians per revision:

    python -m research.benchmarks.step_revisions --base b9bc76b
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tree, networks, windows):
    command = [
        sys.executable,
        "-m",
        "research.benchmarks.head_cost",
        "--networks",
        *networks,
        "--windows",
        str(windows),
    ]
    environment = {**os.environ, "PYTHONPATH": str(tree)}
    output = subprocess.run(
        command, cwd=tree, env=environment, capture_output=True, text=True, check=True
    ).stdout
    results = {}
    for line in output.splitlines():
        if line.startswith("{"):
            results.update(json.loads(line))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare with")
    parser.add_argument(
        "--networks", nargs="+", default=["fashion_mnist_cnn", "mlp_26_classes"]
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--windows", type=int, default=7)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.base],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            runs = {args.base: [], "working tree": []}
            for _ in range(args.rounds):
                for name, tree in ((args.base, base), ("working tree", ROOT)):
                    result = _run(tree, args.networks, args.windows)
                    runs[name].append(result)
                    print(json.dumps({"revision": name, **result}), flush=True)
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base)],
                cwd=ROOT,
                check=False,
            )
    summary = {}
    for name, results in runs.items():
        summary[name] = {
            network: {
                "duq_ms": round(
                    statistics.median(
                        r[network]["softmax_ms"] * r[network]["ratios"]["default"]
                        for r in results
                    ),
                    2,
                ),
                "ratio_to_softmax": statistics.median(
                    r[network]["ratios"]["default"] for r in results
                ),
            }
            for network in args.networks
        }
    print(json.dumps({"median": summary}), flush=True)
    return summary


if __name__ == "__main__":
    main()
