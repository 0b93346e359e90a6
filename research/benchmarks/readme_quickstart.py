"""Runs the README's quickstart as written, for several seeds, and reports its numbers.

The quickstart is the first ```python block after the "## Quickstart"
heading of README.md. It is executed unchanged except for two things: its
seed line (`SEED_LINE`) sets the seed asked for, and, with `--mnist-path`,
the MNIST download replaced by `keras_duq.datasets.load_mnist_test(path)`
for machines without network (the same images). The block must leave
`accuracy` and `metrics` (the output of `evaluation.ood_metrics`) defined.

Example:

```bash
KERAS_HOME=../shared/data/keras python -m research.benchmarks.readme_quickstart \
    --seeds 0 1 2 --mnist-path ../shared/data/mnist --output quickstart.json
```
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import re
import statistics
import time

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
MNIST_LINE = "(_, _), (x_ood, _) = keras.datasets.mnist.load_data()"
SEED_LINE = "keras.utils.set_random_seed(0)"
WRAP_CALL = "keras_duq.wrap(backbone, num_classes=10"


def quickstart_code(readme: str = README.read_text()) -> str:
    """The first python block after the Quickstart heading."""
    section = readme.split("## Quickstart", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    return match.group(1)


def run(seed: int, mnist_path: str | None, wrap_arguments: str = "") -> dict:
    code = quickstart_code()
    if wrap_arguments:
        # A candidate default, measured on the quickstart as written otherwise.
        if WRAP_CALL not in code:
            raise ValueError(f"The quickstart no longer contains {WRAP_CALL!r}.")
        code = code.replace(WRAP_CALL, f"{WRAP_CALL}, {wrap_arguments}")
    if mnist_path:
        if MNIST_LINE not in code:
            raise ValueError(f"The quickstart no longer contains {MNIST_LINE!r}.")
        code = code.replace(
            MNIST_LINE,
            f"x_ood, _ = keras_duq.datasets.load_mnist_test({mnist_path!r})",
        )
    namespace: dict = {}
    start = time.time()
    if SEED_LINE not in code:
        raise ValueError(f"The quickstart no longer contains {SEED_LINE!r}.")
    code = code.replace(SEED_LINE, f"keras.utils.set_random_seed({seed})")
    exec(code, namespace)
    return {
        "seed": seed,
        "accuracy": float(namespace["accuracy"]),
        "auroc": float(namespace["metrics"]["auroc"]),
        "seconds": time.time() - start,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--mnist-path", default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument(
        "--wrap-arguments",
        default="",
        help='More `wrap` arguments, as Python source: "projection_learning_rate=1.0".',
    )
    args = parser.parse_args(argv)
    import keras
    import tensorflow as tf

    import keras_duq

    runs = [run(seed, args.mnist_path, args.wrap_arguments) for seed in args.seeds]
    summary = {
        key: {
            "mean": statistics.mean(r[key] for r in runs),
            "min": min(r[key] for r in runs),
            "max": max(r[key] for r in runs),
        }
        for key in ("accuracy", "auroc")
    }
    report = {
        "runs": runs,
        "summary": summary,
        "code": quickstart_code(),
        "wrap_arguments": args.wrap_arguments,
        "keras_duq": keras_duq.__version__,
        "keras": keras.__version__,
        "tensorflow": tf.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    print(json.dumps(summary, indent=2))
    if args.output:
        pathlib.Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
