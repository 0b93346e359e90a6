"""The library's defaults beyond FashionMNIST: small data, text, two moons, images.

Each problem is trained with `keras_duq.wrap`'s defaults (plus the
problem-specific arguments a problem names, e.g. two moons' head) and,
where asked, a softmax head on the same backbone; every run appends one JSON
record to `--output`.

    python -m research.benchmarks.recipe --problem small_data --seeds 0 1 2
    python -m research.benchmarks.recipe --problem clinc150 --seeds 0 1 2 --softmax
    python -m research.benchmarks.recipe --problem two_moons --seeds $(seq 0 19)
    python -m research.benchmarks.recipe --problem two_moons --seeds 0 1 2 --set gradient_penalty=0
    python -m research.benchmarks.recipe --problem cifar10 --seeds 0 1 2 --softmax
    python -m research.benchmarks.recipe --problem cifar10 --seeds 0 1 2 --preset paper \
        --set gradient_penalty=0.5 --label "paper preset"
    python -m research.benchmarks.recipe --problem cifar10 --seeds 0 1 2 --clipnorm 1.0 \
        --label "defaults, clipnorm=1.0"
    TINY_IMAGENET_DIR=/data/tiny-imagenet-200 python -m research.benchmarks.recipe \
        --problem tiny_imagenet --seeds 0 --softmax

`--summarize FILE ...` prints the records as one markdown table (per
problem and label: seeds, failed runs, the per-seed values and their mean).
`--set name=value` overrides one `wrap` argument (a Python literal), to
compare a candidate default with the current one in the same run;
`--preset paper` starts from `keras_duq.PAPER_SETTINGS`; `--softmax-only`
skips DUQ; `--epochs` shortens a problem's budget for a quick look. A DUQ
run that stops on a non-finite update is recorded as `failed`, with the
epochs it completed. The runs behind
docs/reports/beyond_fashion_mnist.md are in `research/reproduction/results/recipe/`.

Problems:

- `small_data`: `Embedding(50, 8)` -> `GlobalAveragePooling1D` ->
  `Dense(16, relu)`, 256 training sequences of 20 token ids whose label is
  whether the mean token id is above the median (learnable by pooling),
  `penalty_input="embedding"`, Adam, batch 32, 20 epochs (160 steps).
  Reported: training accuracy, as the accuracy a model reaches on what it
  was fit to.
- `clinc150`: CLINC150 (`../shared/data/clinc150/data_full.json`): 150
  intents, trained on `train` (15,000 queries), tested on `test` (4,500)
  against `oos_test` (1,000 out-of-scope queries). `TextVectorization`
  (20,000 tokens, 32 per query) -> `Embedding(20000, 64)` ->
  `GlobalAveragePooling1D` -> `Dense(128, relu)`, `penalty_input` on the
  embeddings, Adam, batch 64, 10 epochs. Softmax scores with its maximum
  probability.
- `hwu64_held_out`: HWU64 (64 home-assistant intents, 11,036 queries;
  Liu et al., 2019), rebuilt in `$HWU64_DIR` from GitHub
  `xliuhw/NLU-Evaluation-Data` at commit f6071b4 (CC BY 4.0): the test
  sets of its ten cross-validation folds, together every annotated query,
  `git archive f6071b496b17d71e6eb43f543af0707f4ff30557
  CrossValidation/autoGeneFromRealAnno | tar -x -C "$HWU64_DIR"`. A text
  set none of the defaults were chosen on: 48 intents (a seeded draw per
  seed) are in scope, the other 16 are the OoD set; folds 1-8 train, folds
  9-10 test. CLINC150's backbone, optimizer and budget.
- `banking77_held_out`: Banking77 (77 banking intents; Casanueva et al.,
  2020), `train.csv` and `test.csv` of `banking_data/` in GitHub
  `PolyAI-LDN/task-specific-datasets` at commit 57ec275 (CC BY 4.0) in
  `$BANKING77_DIR`: 60 intents (a seeded draw per seed) in scope, trained
  on `train` (about 7,800 queries) and tested on `test`; the test queries
  of the other 17 are the OoD set. CLINC150's backbone, optimizer and
  budget.
- `ag_news`: AG News (4 news topics; Zhang et al., 2015): its 7,600 test
  articles (title and description; `ag_news_csv/test.csv` of GitHub
  `madhubandru/Text-Classification-on-News-Articles-using-BERT-Framework`
  at commit 082f2db, in `$AG_NEWS_CSV`), split 70 / 30 into training and
  test sets by seed; the OoD set is Banking77's 3,080 test queries
  (`$BANKING77_DIR`). CLINC150's backbone, optimizer and budget. The
  articles fill the 32 tokens (30.6 on average), the queries 10.8: the
  number of padding tokens alone ranks them at AUROC 0.98.
- `ag_news_titles`: `ag_news` with each article's title only (9 tokens on
  average), so that length no longer tells the OoD queries apart.
- `two_moons`: the paper's problem-specific arguments (3x20 MLP,
  `centroid_dims=10`, `length_scale=0.3`, `momentum=0.99`, penalty 1.0, `W ~
  N(0, 1)`, SGD 0.01 momentum 0.9, 30 epochs, batch 64) and the library's
  defaults otherwise; the demo's bar of `research.reproduction.two_moons`.
- `cifar10`: CIFAR-10 from `../shared/data/cifar10/cifar10_jpg.zip`, 500
  training images per class (a seeded draw: 5,000 of 50,000), tested on the
  10,000 test images against the 10,000 Tiny-ImageNet test images at 32x32
  (`../shared/data/tiny_imagenet/test_resize32.npz`). A ResNet-20-like
  backbone (`small_resnet`: widths 16 / 32 / 64, two blocks per stage,
  BatchNormalization, a random horizontal flip), per-channel
  standardisation, SGD 0.05 momentum 0.9 with a cosine decay over the run
  (softmax gets weight decay 1e-4 from the optimizer; DUQ has its own),
  batch 128, 10 epochs.
- `tiny_imagenet`: Tiny-ImageNet-200 rebuilt in `$TINY_IMAGENET_DIR`
  (research/reproduction/shared_data.py), 200 classes, the first 50 training images
  of each (10,000 of 100,000) box-resized to 32x32, tested on the 10,000
  validation images against the CIFAR-10 test images; the same backbone,
  optimizer and budget as `cifar10`.
- `wine` and `digits_held_out`: scikit-learn's bundled tabular sets with
  classes held out as the OoD set: wine (13 features) trained on two of
  its three cultivars (91 training rows, 150 epochs: 450 steps), the 8x8
  digits (64 features) on digits 0-4 (630 training rows, 30 epochs: 600
  steps); 70 / 30 training / test split of the known classes, standardised
  features, two `Dense(64, relu)` layers, Adam, batch 32.
- `letters_held_out`: the UCI letter-recognition rows (20,000 glyphs as 16
  integer features), 13 letters drawn by the seed trained on (about 7,000
  training rows, 10 epochs: about 2,200 steps), the other 13 letters as the
  OoD set; the split, scaling and MLP of `wine`. The file is read from
  `$LETTER_RECOGNITION_DATA` or `shared/data/letter_recognition/`; it is not
  in the shared copy as given: take it from a clone of the public GitHub
  repository davidgasquez/letter-recognition,

      git -C <copy of davidgasquez/letter-recognition> show \\
          fe3c4830d0003e53340bbf40a57c3573e021df64:letter-recognition.data \\
          > shared/data/letter_recognition/letter-recognition.data

  (a header line, then 20,000 rows; md5 8f70ff1a7ff8e36f62f5cee407209a41).
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import platform
import time
import warnings

import keras
import numpy as np

import keras_duq
from keras_duq import evaluation
from research.benchmarks import mistakes

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "..", "shared", "data")
# Where the text sets are when their variables are unset: the shared copies.
SHARED_DEFAULTS = {
    "HWU64_DIR": os.path.join(SHARED, "hwu64"),
    "BANKING77_DIR": os.path.join(SHARED, "banking77"),
    "AG_NEWS_CSV": os.path.join(SHARED, "ag_news", "test.csv"),
    "LETTER_RECOGNITION_DATA": os.path.join(
        SHARED, "letter_recognition", "letter-recognition.data"
    ),
}
CLINC150 = os.path.join(
    HERE, "..", "..", "..", "shared", "data", "clinc150", "data_full.json"
)


def small_data(seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 50, size=(256, 20)).astype("int32")
    means = x.mean(axis=1)
    y = (means > np.median(means)).astype("int32")
    x_test = rng.integers(1, 50, size=(1000, 20)).astype("int32")
    y_test = (x_test.mean(axis=1) > np.median(means)).astype("int32")

    def backbone():
        return keras.Sequential(
            [
                keras.Input((20,), dtype="int32"),
                keras.layers.Embedding(50, 8, name="embedding"),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(16, activation="relu"),
            ]
        )

    return {
        "train": (x, y),
        "test": (x_test, y_test),
        "ood": None,
        "backbone": backbone,
        "num_classes": 2,
        "wrap": {"penalty_input": "embedding"},
        "optimizer": lambda method: keras.optimizers.Adam(),
        "batch_size": 32,
        "epochs": 20,
    }


def clinc150(seed):
    with open(CLINC150) as f:
        data = json.load(f)
    intents = sorted({intent for _, intent in data["train"]})
    index = {intent: i for i, intent in enumerate(intents)}

    def split(name):
        texts = np.array([text for text, _ in data[name]])
        labels = np.array([index.get(intent, -1) for _, intent in data[name]])
        return texts, labels

    return _text_problem(split("train"), split("test"), split("oos_test")[0])


def _data_path(variable, what):
    """The path in environment variable `variable`, which must hold `what`."""
    path = os.environ.get(variable) or SHARED_DEFAULTS.get(variable)
    if not path or not os.path.exists(path):
        raise ValueError(f"Set {variable} to {what} (see the module docstring).")
    return path


def _known_intents(intents, count, seed):
    """`{intent: class}` for `count` of `intents` drawn by `seed`; the rest are OoD."""
    known = sorted(np.random.default_rng(seed).permutation(sorted(intents))[:count])
    return {intent: i for i, intent in enumerate(known)}


def hwu64_held_out(seed):
    """HWU64's queries: 48 intents in scope, the other 16 (a seeded draw) OoD."""
    import csv
    import glob

    folder = _data_path(
        "HWU64_DIR", "the folder rebuilt from xliuhw/NLU-Evaluation-Data"
    )
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.csv"), recursive=True)):
        fold = int(path.split("KFold_")[1].split(os.sep)[0])
        with open(path, newline="") as f:
            for row in csv.DictReader(f, delimiter=";"):
                intent = row["scenario"] + "_" + row["intent"]
                rows.append((fold, intent, row["answer_from_anno"]))
    if not rows:
        raise ValueError(f"No HWU64 CSV files under HWU64_DIR={folder!r}")
    index = _known_intents({intent for _, intent, _ in rows}, 48, seed)
    texts = np.array([text for _, _, text in rows])
    labels = np.array([index.get(intent, -1) for _, intent, _ in rows])
    train = np.array([fold <= 8 for fold, _, _ in rows]) & (labels >= 0)
    test = np.array([fold > 8 for fold, _, _ in rows])
    return _text_problem(
        (texts[train], labels[train]),
        (texts[test & (labels >= 0)], labels[test & (labels >= 0)]),
        texts[test & (labels < 0)],
    )


def banking77_held_out(seed):
    """Banking77's queries: 60 intents in scope, the other 17 (a seeded draw) OoD."""
    import csv

    folder = _data_path("BANKING77_DIR", "the folder holding Banking77's CSV files")
    splits = {}
    for name in ("train", "test"):
        with open(os.path.join(folder, f"{name}.csv"), newline="") as f:
            splits[name] = [(row["text"], row["category"]) for row in csv.DictReader(f)]
    index = _known_intents({intent for _, intent in splits["train"]}, 60, seed)

    def split(name):
        texts = np.array([text for text, _ in splits[name]])
        labels = np.array([index.get(intent, -1) for _, intent in splits[name]])
        return texts, labels

    (x, y), (x_test, y_test) = split("train"), split("test")
    return _text_problem(
        (x[y >= 0], y[y >= 0]),
        (x_test[y_test >= 0], y_test[y_test >= 0]),
        x_test[y_test < 0],
    )


def ag_news(seed, parts=("title", "description")):
    """AG News's 7,600 test articles (4 topics), split 70 / 30 by seed; OoD:
    Banking77's test queries (short, in-scope for no topic)."""
    import csv

    path = _data_path("AG_NEWS_CSV", "AG News's test.csv")
    banking = _data_path("BANKING77_DIR", "the folder holding Banking77's CSV files")
    with open(path, newline="") as f:
        rows = [
            (" ".join(r[part] for part in parts), int(r["label"]) - 1)
            for r in csv.DictReader(f)
        ]
    texts = np.array([text for text, _ in rows])
    labels = np.array([label for _, label in rows])
    order = np.random.default_rng(seed).permutation(len(rows))
    cut = int(0.7 * len(rows))
    train, test = order[:cut], order[cut:]
    with open(os.path.join(banking, "test.csv"), newline="") as f:
        ood = np.array([row["text"] for row in csv.DictReader(f)])
    return _text_problem(
        (texts[train], labels[train]), (texts[test], labels[test]), ood
    )


# `--mask-zero`: the text problems' Embedding leaves padding out of the pooling.
MASK_ZERO = False


def _text_problem(train, test, ood):
    """CLINC150's text model on `(texts, labels)` pairs and OoD texts.

    `TextVectorization` (20,000 tokens, 32 per query) adapted to the
    training texts -> `Embedding(20000, 64)` -> `GlobalAveragePooling1D` ->
    `Dense(128, relu)`, the penalty on the embeddings, Adam, batch 64,
    10 epochs.
    """
    vectorize = keras.layers.TextVectorization(
        max_tokens=20_000, output_sequence_length=32
    )
    vectorize.adapt(train[0])

    def ids(texts):
        return keras.ops.convert_to_numpy(vectorize(texts)).astype("int32")

    def backbone():
        return keras.Sequential(
            [
                keras.Input((32,), dtype="int32"),
                keras.layers.Embedding(
                    20_000, 64, mask_zero=MASK_ZERO, name="embedding"
                ),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(128, activation="relu"),
            ]
        )

    return {
        "train": (ids(train[0]), train[1].astype("int32")),
        "test": (ids(test[0]), test[1].astype("int32")),
        "ood": ids(ood),
        "backbone": backbone,
        "num_classes": int(train[1].max()) + 1,
        "wrap": {"penalty_input": "embedding"},
        "optimizer": lambda method: keras.optimizers.Adam(),
        "batch_size": 64,
        "epochs": 10,
    }


def two_moons(seed):
    from research.reproduction import two_moons as moons

    (x_train, y_train), (x_test, y_test), x_far = moons.make_data(seed)
    return {
        "train": (x_train, y_train),
        "test": (x_test, y_test),
        "ood": x_far,
        "backbone": lambda: moons.build_backbone("paper"),
        "num_classes": 2,
        "wrap": {
            "centroid_dims": 10,
            "length_scale": 0.3,
            "momentum": 0.99,
            "gradient_penalty": 1.0,
            "kernel_initializer": keras.initializers.RandomNormal(stddev=1.0),
        },
        "optimizer": lambda method: keras.optimizers.SGD(0.01, momentum=0.9),
        "batch_size": 64,
        "epochs": 30,
    }


def small_resnet(input_shape, widths=(16, 32, 64)):
    """A ResNet-20-like backbone: three stages of two residual blocks."""

    def block(x, filters, stride):
        shortcut = x
        x = keras.layers.Conv2D(filters, 3, stride, "same", use_bias=False)(x)
        x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = keras.layers.Conv2D(filters, 1, stride, use_bias=False)(shortcut)
            shortcut = keras.layers.BatchNormalization()(shortcut)
        return keras.layers.ReLU()(x + shortcut)

    inputs = keras.Input(input_shape)
    x = keras.layers.RandomFlip("horizontal")(inputs)
    x = keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False)(x)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    for stage, filters in enumerate(widths):
        for index in range(2):
            x = block(x, filters, 2 if stage > 0 and index == 0 else 1)
    return keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(x))


def _standardize(x_train, *others):
    x_train = x_train.astype("float32") / 255.0
    mean = x_train.mean(axis=(0, 1, 2))
    std = x_train.std(axis=(0, 1, 2))
    return [(x_train - mean) / std] + [
        (x.astype("float32") / 255.0 - mean) / std for x in others
    ]


def _image_problem(train, test, ood, num_classes, epochs, batch_size=128):
    (x_train, y_train), (x_test, y_test) = train, test
    x_train, x_test, x_ood = _standardize(x_train, x_test, ood)
    steps = epochs * (len(x_train) // batch_size + (len(x_train) % batch_size > 0))

    def optimizer(method):
        # The paper's SGD, a cosine decay over the run: one budget for all.
        schedule = keras.optimizers.schedules.CosineDecay(0.05, steps)
        return keras.optimizers.SGD(
            schedule,
            momentum=0.9,
            # DUQ's weight decay is built in (`weight_decay=1e-4`).
            weight_decay=1e-4 if method == "softmax" else None,
        )

    return {
        "train": (x_train, y_train),
        "test": (x_test, y_test),
        "ood": x_ood,
        "backbone": lambda: small_resnet(x_train.shape[1:]),
        "num_classes": num_classes,
        "wrap": {},
        "optimizer": optimizer,
        "batch_size": batch_size,
        "epochs": epochs,
    }


def _subset(x, y, per_class, seed):
    rng = np.random.default_rng(seed)
    keep = np.concatenate(
        [rng.permutation(np.flatnonzero(y == c))[:per_class] for c in np.unique(y)]
    )
    keep = rng.permutation(keep)
    return x[keep], y[keep]


def cifar10(seed):
    from research.reproduction import shared_data

    train, test = shared_data.cifar10()
    train = _subset(*train, CIFAR10_PER_CLASS, seed)
    return _image_problem(
        train, test, shared_data.tiny_imagenet_resize(), 10, epochs=10
    )


def tiny_imagenet(seed):
    from research.reproduction import shared_data

    directory = os.environ.get("TINY_IMAGENET_DIR")
    if not directory:
        raise ValueError(
            "Set TINY_IMAGENET_DIR to the rebuilt tiny-imagenet-200 folder "
            "(research/reproduction/shared_data.py says how)."
        )
    train, test = shared_data.tiny_imagenet_200(
        directory, per_class=TINY_IMAGENET_PER_CLASS, size=32
    )
    _, (x_cifar, _) = shared_data.cifar10()
    return _image_problem(train, test, x_cifar, 200, epochs=10)


# CPU budgets: a tenth of the training images of each, the first
# `per_class` of a seeded shuffle (CIFAR-10) or by file number
# (Tiny-ImageNet-200, box-resized to 32x32).
CIFAR10_PER_CLASS = 500
TINY_IMAGENET_PER_CLASS = 50
CIFAR10_CNN_PER_CLASS = 1000
FASHION_MNIST_PER_CLASS = 1000
MNIST_DIR = os.path.join(HERE, "..", "..", "..", "shared", "data", "mnist")


def _held_out_classes(x, y, known, seed, epochs):
    """`known` classes split 70 / 30 into training and test; the rest is OoD.

    Features standardised with the training split's statistics; an MLP of
    two `Dense(64, relu)` layers, Adam, batch 32.
    """
    rng = np.random.default_rng(seed)
    mask = np.isin(y, known)
    x_known = x[mask]
    y_known = np.searchsorted(np.asarray(known), y[mask]).astype("int32")
    order = rng.permutation(len(x_known))
    train, test = np.split(order, [int(0.7 * len(order))])
    mean = x_known[train].mean(axis=0)
    std = x_known[train].std(axis=0) + 1e-8

    def scaled(values):
        return ((values - mean) / std).astype("float32")

    def backbone():
        return keras.Sequential(
            [
                keras.Input((x.shape[1],)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(64, activation="relu"),
            ]
        )

    return {
        "train": (scaled(x_known[train]), y_known[train]),
        "test": (scaled(x_known[test]), y_known[test]),
        "ood": scaled(x[~mask]),
        "backbone": backbone,
        "num_classes": len(known),
        "wrap": {},
        "optimizer": lambda method: keras.optimizers.Adam(),
        "batch_size": 32,
        "epochs": epochs,
    }


def wine(seed):
    from sklearn.datasets import load_wine

    x, y = load_wine(return_X_y=True)
    return _held_out_classes(x, y, known=[0, 1], seed=seed, epochs=150)


def digits_held_out(seed):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return _held_out_classes(x, y, known=[0, 1, 2, 3, 4], seed=seed, epochs=30)


def letters_held_out(seed):
    path = _data_path("LETTER_RECOGNITION_DATA", "the UCI letter-recognition.data file")
    rows = np.loadtxt(path, delimiter=",", dtype=str)
    if len(rows[0, 0]) > 1:  # a header line ("Letter,1,2,...")
        rows = rows[1:]
    letters = np.array([ord(letter) - ord("A") for letter in rows[:, 0]])
    known = sorted(np.random.default_rng(seed).permutation(26)[:13])
    x = rows[:, 1:].astype("float32")
    return _held_out_classes(x, letters, known=known, seed=seed, epochs=10)


def quickstart_cnn(dropout=0.5):
    """The README quickstart's backbone: keras.io's MNIST convnet, `Dropout`,
    `Dense(128)`."""
    from research.benchmarks.own_model_defaults import _keras_io_layers

    return keras.Sequential(
        [
            *_keras_io_layers(),
            keras.layers.Dropout(dropout),
            keras.layers.Dense(128, activation="relu"),
        ]
    )


def fashion_mnist(seed):
    """FashionMNIST against MNIST's test digits: the README quickstart's
    backbone and optimizer on a seeded tenth of the training images."""
    from keras_duq import datasets

    (x, y), (x_test, y_test) = keras.datasets.fashion_mnist.load_data()
    x, y = _subset(x, y, FASHION_MNIST_PER_CLASS, seed)
    x_ood, _ = datasets.load_mnist_test(MNIST_DIR)

    return {
        "train": (datasets.normalize(x), y.astype("int32")),
        "test": (datasets.normalize(x_test), y_test.astype("int32")),
        "ood": datasets.normalize(x_ood),
        "backbone": quickstart_cnn,
        "num_classes": 10,
        "wrap": {},
        "optimizer": lambda method: keras.optimizers.Adam(),
        "batch_size": 128,
        "epochs": 3,
    }


def cifar10_cnn(seed):
    """CIFAR-10 against Tiny-ImageNet's test images at 32x32 with a small
    CNN (four convolutions, no BatchNormalization), Adam, 5 epochs on a
    seeded fifth of the training images: a CPU budget."""
    from research.reproduction import shared_data

    train, test = shared_data.cifar10()
    (x, y), (x_test, y_test) = _subset(*train, CIFAR10_CNN_PER_CLASS, seed), test
    x, x_test, x_ood = _standardize(x, x_test, shared_data.tiny_imagenet_resize())

    def backbone():
        conv = functools.partial(
            keras.layers.Conv2D, kernel_size=3, padding="same", activation="relu"
        )
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                conv(32),
                conv(32),
                keras.layers.MaxPooling2D(),
                conv(64),
                conv(64),
                keras.layers.MaxPooling2D(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(128, activation="relu"),
            ]
        )

    return {
        "train": (x, y.astype("int32")),
        "test": (x_test, y_test.astype("int32")),
        "ood": x_ood,
        "backbone": backbone,
        "num_classes": 10,
        "wrap": {},
        "optimizer": lambda method: keras.optimizers.Adam(),
        "batch_size": 128,
        "epochs": 5,
    }


PROBLEMS = {
    "small_data": small_data,
    "clinc150": clinc150,
    "hwu64_held_out": hwu64_held_out,
    "banking77_held_out": banking77_held_out,
    "ag_news": ag_news,
    "ag_news_titles": functools.partial(ag_news, parts=("title",)),
    "two_moons": two_moons,
    "cifar10": cifar10,
    "tiny_imagenet": tiny_imagenet,
    "wine": wine,
    "digits_held_out": digits_held_out,
    "letters_held_out": letters_held_out,
    "fashion_mnist": fashion_mnist,
    "cifar10_cnn": cifar10_cnn,
}


class EpochLog(keras.callbacks.Callback):
    """Keeps each epoch's logs, so a run that stops early still reports them."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({k: round(float(v), 4) for k, v in (logs or {}).items()})


def build(spec, method, overrides=None, clipnorm=None):
    """A problem's compiled model: `keras_duq.wrap`'s defaults with the
    problem's arguments and `overrides` (`method="duq"`), or a softmax
    `Dense` head on the same backbone (`"softmax"`)."""
    backbone = spec["backbone"]()
    optimizer = spec["optimizer"](method)
    if clipnorm is not None:
        # Each gradient clipped to this norm (Keras's `clipnorm`), both heads.
        optimizer.clipnorm = clipnorm
    if method == "softmax":
        model = keras.Sequential(
            [backbone, keras.layers.Dense(spec["num_classes"], activation="softmax")]
        )
        model.compile(
            optimizer=optimizer,
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
        return model
    model = keras_duq.wrap(
        backbone,
        num_classes=spec["num_classes"],
        **{**spec["wrap"], **(overrides or {})},
    )
    model.compile(optimizer=optimizer)
    return model


def run(problem, seed, method, overrides, epochs=None, clipnorm=None, defaults=False):
    """One run's record. `defaults`: `wrap(backbone, num_classes)` alone (a
    token model's `penalty_input` kept), without the problem's own arguments."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    spec = PROBLEMS[problem](seed)
    if defaults:
        spec["wrap"] = {k: v for k, v in spec["wrap"].items() if k == "penalty_input"}
    if epochs is not None:
        spec["epochs"] = epochs
    x, y = spec["train"]
    x_test, y_test = spec["test"]
    keras.utils.set_random_seed(seed)
    model = build(spec, method, overrides, clipnorm)
    base = {
        "problem": problem,
        "method": method,
        "seed": seed,
        "overrides": {k: repr(v) for k, v in overrides.items()},
        "epochs": spec["epochs"],
    }
    if clipnorm is not None:
        base["clipnorm"] = clipnorm
    start = time.perf_counter()
    log = EpochLog()
    caught = warnings.catch_warnings(record=True)
    fired = caught.__enter__()
    warnings.simplefilter("always", keras_duq.DUQHealthWarning)
    try:
        history = model.fit(
            x,
            y,
            batch_size=spec["batch_size"],
            epochs=spec["epochs"],
            verbose=0,
            callbacks=[log],
        )
    except Exception as error:
        caught.__exit__(None, None, None)
        # DUQ stops training on a non-finite update: a measured outcome.
        if "non-finite" not in str(error):
            raise
        return {
            **base,
            "failed": "non-finite update in epoch " + str(len(log.epochs) + 1),
            "train_seconds": round(time.perf_counter() - start, 1),
            "history": log.epochs,
        }
    seconds = time.perf_counter() - start
    train_scores = model.predict(x, batch_size=1000, verbose=0)
    test_scores = model.predict(x_test, batch_size=1000, verbose=0)
    caught.__exit__(None, None, None)
    record = {
        "warnings": sorted(
            {
                type(w.message).__name__
                for w in fired
                if isinstance(w.message, keras_duq.DUQHealthWarning)
            }
        ),
        **base,
        "train_accuracy": float(np.mean(train_scores.argmax(1) == y)),
        "test_accuracy": float(np.mean(test_scores.argmax(1) == y_test)),
        "test_certainty_mean": float(test_scores.max(1).mean()),
        "train_seconds": round(seconds, 1),
        "history": {
            k: [round(float(v), 4) for v in values]
            for k, values in history.history.items()
            if k in ("accuracy", "certainty", "gradient_penalty")
        },
    }
    if spec["ood"] is not None:
        ood_scores = model.predict(spec["ood"], batch_size=1000, verbose=0)
        metrics = evaluation.ood_metrics(test_scores.max(1), ood_scores.max(1))
        record.update(
            ood_auroc=float(metrics["auroc"]),
            ood_fpr_at_95_tpr=float(metrics["fpr_at_95_tpr"]),
            ood_certainty_mean=float(ood_scores.max(1).mean()),
            **_threshold_from_validation(test_scores.max(1), ood_scores.max(1), seed),
            mistakes=mistakes.metrics(method, test_scores, y_test, ood_scores, seed),
        )
    if problem == "two_moons" and method == "duq":
        from research.reproduction import two_moons as moons

        record["meets_bar"] = bool(
            moons.meets_bar(
                {
                    "test_accuracy": record["test_accuracy"],
                    "far_certainty_mean": record["ood_certainty_mean"],
                    "auroc_test_vs_far": record["ood_auroc"],
                }
            )
        )
    return record


def _threshold_from_validation(certainty, ood_certainty, seed, keep=0.95):
    """The deployment rule of docs/guide/calibration.md, measured: a threshold
    that accepts `keep` of one half of the in-distribution test set (the
    validation half, a seeded draw), and what it accepts of the other half
    and of the OoD set."""
    order = np.random.default_rng(seed + 7919).permutation(len(certainty))
    validation, held_out = order[: len(order) // 2], order[len(order) // 2 :]
    threshold = evaluation.certainty_threshold(certainty[validation], keep=keep)
    return {
        "threshold_keep95": threshold,
        "held_out_accepted": float(np.mean(certainty[held_out] >= threshold)),
        "ood_accepted": float(np.mean(ood_certainty >= threshold)),
    }


def summarize(paths):
    """Markdown rows: per problem, label and epochs, the seeds and the mean of each metric."""
    groups = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                key = (
                    record["problem"],
                    record.get("label", record["method"]),
                    record.get("epochs", "-"),
                )
                groups.setdefault(key, []).append(record)
    rows = [
        "| problem | settings | epochs | seeds | failed | train accuracy "
        "| test accuracy | OoD AUROC | FPR at 95% TPR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def mean(records, name):
        values = [r[name] for r in records if r.get(name) is not None]
        if not values:
            return "-"
        per_seed = " / ".join(f"{v:.3f}" for v in values)
        return f"{per_seed} ({np.mean(values):.3f})" if len(values) > 1 else per_seed

    for (problem, label, epochs), records in groups.items():
        seeds = ", ".join(str(r["seed"]) for r in records)
        failed = sum("failed" in r for r in records)
        cells = [
            mean(records, name)
            for name in (
                "train_accuracy",
                "test_accuracy",
                "ood_auroc",
                "ood_fpr_at_95_tpr",
            )
        ]
        rows.append(
            f"| {problem} | {label} | {epochs} | {seeds} | {failed} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summarize", nargs="+", metavar="JSONL", default=None)
    parser.add_argument("--problem", choices=sorted(PROBLEMS), required=False)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--softmax", action="store_true", help="Also a softmax head.")
    parser.add_argument(
        "--mask-zero",
        action="store_true",
        help="Text problems: an Embedding with mask_zero=True (padding left out "
        "of the pooled average), for both heads.",
    )
    parser.add_argument(
        "--softmax-only", action="store_true", help="A softmax head only."
    )
    parser.add_argument(
        "--preset",
        choices=["paper"],
        default=None,
        help="Start from keras_duq.PAPER_SETTINGS (the paper's loss and W rate).",
    )
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--label", default="defaults")
    parser.add_argument(
        "--epochs", type=int, default=None, help="The problem's if unset."
    )
    parser.add_argument(
        "--clipnorm",
        type=float,
        default=None,
        help="Clip each gradient to this norm (the optimizer's `clipnorm`).",
    )
    parser.add_argument("--output", default=None, help="JSONL file to append to.")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return
    if args.problem is None:
        parser.error("--problem is required (or --summarize)")
    global MASK_ZERO
    MASK_ZERO = args.mask_zero
    overrides = dict(keras_duq.PAPER_SETTINGS) if args.preset == "paper" else {}
    for item in args.set:
        name, value = item.split("=", 1)
        overrides[name] = ast.literal_eval(value)
    methods = ["duq"] + (["softmax"] if args.softmax else [])
    if args.softmax_only:
        methods = ["softmax"]
    softmax_label = (
        "softmax"
        + (f", clipnorm={args.clipnorm:g}" if args.clipnorm is not None else "")
        + (", mask_zero" if args.mask_zero else "")
    )
    for seed in args.seeds:
        for method in methods:
            record = run(
                args.problem,
                seed,
                method,
                overrides if method == "duq" else {},
                args.epochs,
                args.clipnorm,
            )
            record.update(
                label=args.label if method == "duq" else softmax_label,
                keras_duq=keras_duq.__version__,
                keras=keras.__version__,
                backend=keras.backend.backend(),
                cpu=platform.processor() or platform.machine(),
            )
            emit(record, args.output)


def emit(record, output=None):
    """Prints `record` as one JSON line and appends it to `output` if given."""
    line = json.dumps(record)
    print(line, flush=True)
    if output:
        with open(output, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
