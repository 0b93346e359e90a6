"""How the projected features' spread, the length scale and the distances move in training.

One problem of `research.benchmarks.recipe` with `wrap`'s defaults: before
training and after each epoch, on 1,000 test inputs, the spread of the
projected features (`_ops.embedding_scale`'s root mean variance), the
length scale, the median squared distance of an input to its own class's
centroid and to the other classes' (median over classes), and the mean
certainty; with the epoch's loss, cross-entropy and gradient penalty.

    python -m research.benchmarks.feature_spread --problem clinc150
    python -m research.benchmarks.feature_spread --problem clinc150 --centroid-dims 16
"""

from __future__ import annotations

import argparse

import keras
import numpy as np

from research.benchmarks import recipe


def _report(model, x, y, tag):
    head = model.duq_output
    features = model.feature_extractor.predict(x, verbose=0)
    embeddings = keras.ops.convert_to_numpy(head.embed(keras.ops.convert_to_tensor(features)))
    centroids = keras.ops.convert_to_numpy(head.centroids)
    distances = ((embeddings - centroids[None]) ** 2).mean(axis=1)  # (batch, classes)
    length_scale = float(keras.ops.convert_to_numpy(head.length_scales)[0])
    own = distances[np.arange(len(y)), y]
    spread = float(np.sqrt(embeddings.var(axis=0).mean()))
    certainty = np.exp(-distances.min(axis=1) / (2 * length_scale**2)).mean()
    print(
        f"{tag}: spread {spread:.4g}, length scale {length_scale:.4g} "
        f"(2 sigma^2 {2 * length_scale**2:.3g}), median squared distance to own "
        f"centroid {np.median(own):.3g}, to others {np.median(np.median(distances, axis=1)):.3g}, "
        f"mean certainty {certainty:.3g}",
        flush=True,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="clinc150", choices=sorted(recipe.PROBLEMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--centroid-dims", type=int, default=None)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(args.seed)
    spec = recipe.PROBLEMS[args.problem](args.seed)
    spec["wrap"] = {k: v for k, v in spec["wrap"].items() if k == "penalty_input"}
    x, y = spec["train"]
    x_test, y_test = spec["test"]
    x_test, y_test = x_test[:1000], np.asarray(y_test[:1000])
    keras.utils.set_random_seed(args.seed)
    overrides = {} if args.centroid_dims is None else {"centroid_dims": args.centroid_dims}
    model = recipe.build(spec, "duq", overrides)

    class Report(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            _report(
                model,
                x_test,
                y_test,
                f"epoch {epoch + 1} (loss {logs.get('loss', 0):.3f}, bce "
                f"{logs.get('bce', 0):.3f}, penalty {logs.get('gradient_penalty', 0):.3f})",
            )

    _report(model, x_test, y_test, "before training (length scale not yet measured)")
    model.fit(
        x,
        y,
        epochs=spec["epochs"],
        batch_size=spec.get("batch_size", 64),
        verbose=0,
        callbacks=[Report()],
    )


if __name__ == "__main__":
    main()
