"""
Title: Text classification with DUQ: movie reviews and token ids
Description: Train a DUQ classifier of IMDB reviews on word embeddings, with
the gradient penalty taken with respect to the embeddings.

DUQ's gradient penalty asks that the sum of kernel values change with the
input, neither too fast nor too slowly. A text model's input is token ids,
integers that cannot be differentiated; its `keras.layers.Embedding` turns
them into vectors that can. `keras_duq.wrap(..., penalty_input="embedding")`
takes the penalty with respect to the output of the layer named `embedding`.

    python examples/text_classification.py           # 5 epochs, 25,000 reviews
    python examples/text_classification.py --quick   # a smoke run

Data: `tfds.load("imdb_reviews")` downloads the reviews (80 MB) into
`--data-dir` (default `~/tensorflow_datasets`) on the first run; on a machine
without network, prepare them elsewhere with
`tfds.builder("imdb_reviews", data_dir=DIR).download_and_prepare()` and copy
DIR over. Needs `pip install tensorflow-datasets`; the pipeline uses
TensorFlow's `tf.data`, the model trains on any Keras backend.
"""

# ----------------------------------------------------------------------
# Setup

import argparse
import os

import keras
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

import keras_duq
from keras_duq import evaluation

parser = argparse.ArgumentParser(description="DUQ on IMDB movie reviews.")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--data-dir", default=None, help="tensorflow-datasets' data_dir.")
parser.add_argument(
    "--quick",
    action="store_true",
    default=os.environ.get("KERAS_DUQ_SMOKE") == "1",
    help="A smoke run: 1 epoch on 256 reviews, a small vocabulary.",
)
args = parser.parse_args()
epochs = 1 if args.quick else args.epochs
vocabulary_size, sequence_length = (1000, 64) if args.quick else (20_000, 256)
keras.utils.set_random_seed(0)

# ----------------------------------------------------------------------
# The data
#
# `TextVectorization` learns a vocabulary from the training reviews and turns
# each review into `sequence_length` token ids: 1 for words outside the
# vocabulary, 0 for the padding after the review's end.

train, test = tfds.load(
    "imdb_reviews", split=["train", "test"], as_supervised=True, data_dir=args.data_dir
)
if args.quick:
    train, test = train.take(256), test.take(256)
vectorize = keras.layers.TextVectorization(
    max_tokens=vocabulary_size, output_sequence_length=sequence_length
)
vectorize.adapt(train.map(lambda text, label: text).batch(512))


def to_ids(text, label):
    return vectorize(text), label


# The reviews are cached as text and shuffled anew every epoch.
train = train.cache().shuffle(25_000, seed=0).batch(64).map(to_ids).prefetch(2)
test = test.batch(256).map(to_ids).cache()

# ----------------------------------------------------------------------
# The backbone
#
# Embeddings averaged over the review's words (`mask_zero=True` leaves the
# padding out of the average), then a hidden layer: the features.

backbone = keras.Sequential(
    [
        keras.Input((sequence_length,), dtype="int32"),
        keras.layers.Embedding(vocabulary_size, 64, mask_zero=True, name="embedding"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(64, activation="relu"),
    ]
)

# ----------------------------------------------------------------------
# DUQ, with the penalty on the embeddings
#
# `penalty_input` names the layer whose output the penalty differentiates.
# Without it, a model whose only input is integers raises an error that
# points here when the penalty is on.

model = keras_duq.wrap(
    backbone,
    num_classes=2,
    length_scale=0.1,
    gradient_penalty=0.1,
    penalty_input="embedding",
)
model.compile(optimizer=keras.optimizers.Adam(1e-3))
history = model.fit(train, validation_data=test, epochs=epochs, verbose=2)

# ----------------------------------------------------------------------
# Accuracy and certainty
#
# The certainty is the largest kernel value. A useful one is lower on the
# reviews the model gets wrong: the misclassification AUROC measures how well
# it separates them (0.5: not at all). Reviews of random words, none of them
# a sentence, should get a lower certainty still.

kernel_values = model.predict(test, verbose=0)
labels = np.concatenate([y for _, y in test.as_numpy_iterator()])
certainty = kernel_values.max(axis=1)
correct = kernel_values.argmax(axis=1) == labels
rng = np.random.default_rng(0)
gibberish = rng.integers(2, vocabulary_size, size=(256, sequence_length))
gibberish_certainty = model.predict(gibberish, verbose=0).max(axis=1)
metrics = {
    "accuracy": float(correct.mean()),
    "misclassification_auroc": evaluation.misclassification_auroc(certainty, correct),
    "certainty_right": float(certainty[correct].mean()),
    "certainty_wrong": float(certainty[~correct].mean()) if (~correct).any() else None,
    "certainty_random_words": float(gibberish_certainty.mean()),
}
print(", ".join(f"{n} {v:.3f}" for n, v in metrics.items() if v is not None))

# ----------------------------------------------------------------------
# In use
#
# Raw text in, a prediction and a certainty out: vectorize, then predict.
# Below a threshold chosen on held-out data (here: the certainty that keeps
# 90% of the test reviews) a review would go to a person.

threshold = evaluation.certainty_threshold(certainty, keep=0.9)
reviews = tf.constant(
    ["A wonderful film, I loved every minute.", "Dull and far too long."]
)
predictions = model.predict(vectorize(reviews), verbose=0)
for review, values in zip(reviews.numpy(), predictions):
    verdict = "positive" if values.argmax() == 1 else "negative"
    flag = "" if values.max() >= threshold else "  (uncertain: refer)"
    print(f"{verdict} ({values.max():.2f}){flag}: {review.decode()}")
