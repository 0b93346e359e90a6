"""The library's defaults against a softmax head, on every data set the project has.

Each problem of `research.benchmarks.recipe` runs twice per seed on the same
backbone, optimizer and budget: `keras_duq.wrap(backbone, num_classes)` with
nothing else (a token model's `penalty_input` kept), and a softmax `Dense`
head. Every run appends one JSON record to `--output`; the summary prints
one markdown row per problem: accuracy, OoD AUROC (mean ± standard deviation
over seeds), mean in-distribution certainty (softmax: mean maximum
probability), the DUQ / softmax fit-time ratio and the health warnings that
fired.

    python -m research.benchmarks.defaults --seeds 0 1 2 --output defaults.jsonl
    python -m research.benchmarks.defaults --problems small_data wine --seeds 0 1 2
    python -m research.benchmarks.defaults --summarize defaults.jsonl

The fit time is wall-clock `fit` time of the two heads run one after the
other in one process, so their ratio is comparable where the absolute
seconds are not. The table of docs/reports/defaults.md comes from
`research/reproduction/results/recipe/defaults.jsonl`.
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from research.benchmarks import recipe

PROBLEMS = (
    "small_data",
    "two_moons",
    "wine",
    "digits_held_out",
    "letters_held_out",
    "fashion_mnist",
    "clinc150",
    "banking77_held_out",
    "hwu64_held_out",
    "ag_news_titles",
    "cifar10_cnn",
)


def run(problems, seeds, output=None):
    for problem in problems:
        for seed in seeds:
            for method in ("duq", "softmax"):
                record = recipe.run(problem, seed, method, {}, defaults=True)
                record["label"] = "defaults"
                recipe.emit(record, output)


def _mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}"


def summarize(paths):
    """Markdown rows, one per problem, of the records labelled `defaults`."""
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("label") == "defaults":
                    runs[record["problem"]][record["method"]].append(record)
    rows = [
        "| problem | seeds | accuracy DUQ / softmax | OoD AUROC DUQ | OoD AUROC softmax "
        "| certainty DUQ / softmax | fit time DUQ / softmax | warnings (DUQ) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for problem in sorted(runs, key=lambda p: PROBLEMS.index(p) if p in PROBLEMS else 99):
        duq, softmax = runs[problem]["duq"], runs[problem]["softmax"]
        done = [r for r in duq if "failed" not in r]

        def mean(records, key):
            values = [r[key] for r in records if key in r]
            return np.mean(values) if values else float("nan")

        fired = collections.Counter(w for r in done for w in r.get("warnings", []))
        warned = ", ".join(f"{name} ({n})" for name, n in sorted(fired.items())) or "none"
        failed = len(duq) - len(done)
        rows.append(
            f"| {problem} | {len(done)}{f' (+{failed} failed)' if failed else ''} "
            f"| {mean(done, 'test_accuracy'):.3f} / {mean(softmax, 'test_accuracy'):.3f} "
            f"| {_mean_std([r.get('ood_auroc') for r in done])} "
            f"| {_mean_std([r.get('ood_auroc') for r in softmax])} "
            f"| {mean(done, 'test_certainty_mean'):.3g} / "
            f"{mean(softmax, 'test_certainty_mean'):.3g} "
            f"| {mean(done, 'train_seconds') / mean(softmax, 'train_seconds'):.2f}x "
            f"| {warned} |"
        )
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--output", help="JSONL file the records are appended to")
    parser.add_argument("--summarize", nargs="+", metavar="FILE")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return
    unknown = sorted(set(args.problems) - set(recipe.PROBLEMS))
    if unknown:
        parser.error(f"unknown problems {unknown}; known: {sorted(recipe.PROBLEMS)}")
    run(args.problems, args.seeds, args.output)
    if args.output:
        print(summarize([args.output]))


if __name__ == "__main__":
    main()
