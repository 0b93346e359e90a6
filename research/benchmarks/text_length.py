"""How much of a text OoD benchmark is the inputs' length, and where the OoD queries land.

For a text problem of `research.benchmarks.recipe` (default `ag_news`), per
seed: the OoD AUROC of the padding count alone (fewer real tokens = less
in-distribution), then, for DUQ (`keras_duq.wrap`'s defaults) and a softmax
head on the same backbone trained as the recipe trains them, the OoD AUROC,
the class that most OoD queries are assigned to and their share, and the
AUROC within that class. One JSON line per seed and head.

    AG_NEWS_CSV=... BANKING77_DIR=... python -m research.benchmarks.text_length \
        --problem ag_news --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import json

import keras
import numpy as np

from keras_duq import evaluation
from research.benchmarks import recipe


def auroc(in_scores, ood_scores):
    return float(evaluation.ood_metrics(in_scores, ood_scores)["auroc"])


def run(problem, seed):
    spec = recipe.PROBLEMS[problem](seed)
    (x, y), (x_test, _) = spec["train"], spec["test"]
    x_ood = spec["ood"]
    tokens_test, tokens_ood = (x_test != 0).sum(1), (x_ood != 0).sum(1)
    base = {
        "problem": problem,
        "seed": seed,
        "tokens_test_mean": float(tokens_test.mean()),
        "tokens_ood_mean": float(tokens_ood.mean()),
        "length_auroc": auroc(tokens_test.astype(float), tokens_ood.astype(float)),
    }
    for method in ("duq", "softmax"):
        keras.backend.clear_session()
        keras.utils.set_random_seed(seed)
        model = recipe.build(spec, method)
        model.fit(x, y, batch_size=spec["batch_size"], epochs=spec["epochs"], verbose=0)
        scores_test = model.predict(x_test, batch_size=1000, verbose=0)
        scores_ood = model.predict(x_ood, batch_size=1000, verbose=0)
        counts = np.bincount(scores_ood.argmax(1), minlength=spec["num_classes"])
        top = int(counts.argmax())
        in_top = scores_test.argmax(1) == top
        ood_top = scores_ood.argmax(1) == top
        record = {
            **base,
            "method": method,
            "ood_auroc": auroc(scores_test.max(1), scores_ood.max(1)),
            "ood_top_class": top,
            "ood_top_class_share": float(counts[top] / counts.sum()),
            "ood_auroc_within_top_class": auroc(
                scores_test.max(1)[in_top], scores_ood.max(1)[ood_top]
            ),
        }
        print(json.dumps(record), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="ag_news", choices=sorted(recipe.PROBLEMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args(argv)
    for seed in args.seeds:
        run(args.problem, seed)


if __name__ == "__main__":
    main()
