"""Tests of keras_duq.evaluation: metrics by hand and against scikit-learn."""

import csv
import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn import datasets as sk_datasets
from sklearn import metrics as sk_metrics

import keras_duq

# ------------------------------------------------------------ certainty_scores


def test_certainty_max_by_hand():
    scores = np.array([[0.1, 0.7, 0.2], [0.05, 0.01, 0.0]])
    np.testing.assert_allclose(
        keras_duq.evaluation.certainty_scores(scores), [0.7, 0.05]
    )


def test_certainty_negative_entropy_by_hand():
    probabilities = np.array([[0.5, 0.5], [1.0, 0.0], [0.2, 0.8]])
    expected = [-math.log(2), 0.0, 0.2 * math.log(0.2) + 0.8 * math.log(0.8)]
    np.testing.assert_allclose(
        keras_duq.evaluation.certainty_scores(probabilities, method="negative_entropy"),
        expected,
    )


def test_certainty_orders_confident_before_uniform():
    probabilities = np.array([[0.98, 0.01, 0.01], [1 / 3, 1 / 3, 1 / 3]])
    for method in ("max", "negative_entropy"):
        certainty = keras_duq.evaluation.certainty_scores(probabilities, method=method)
        assert certainty[0] > certainty[1], method


@pytest.mark.parametrize(
    "scores, kwargs, match",
    [
        (np.array([0.1, 0.9]), {}, "shape"),
        (np.ones((2, 2, 2)), {}, "shape"),
        (np.ones((2, 2)), {"method": "entropy"}, "negative_entropy"),
        (np.array([[-1.0, 2.0]]), {"method": "negative_entropy"}, "logits"),
        (np.array([[np.nan, 0.5]]), {}, "NaN"),
    ],
)
def test_certainty_rejects_bad_input(scores, kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_duq.evaluation.certainty_scores(scores, **kwargs)


# ---------------------------------------------------------------- ood_metrics

IN_CERTAINTY = np.array([0.9, 0.8, 0.7, 0.4])
OOD_CERTAINTY = np.array([0.6, 0.3, 0.2])


def test_ood_metrics_by_hand():
    metrics = keras_duq.evaluation.ood_metrics(IN_CERTAINTY, OOD_CERTAINTY)
    # Pairs (in, OoD) with the OoD example less certain: 3 + 4 + 4 of 12.
    assert metrics["auroc"] == pytest.approx(11 / 12)
    # Least certain first: OoD, OoD, in, OoD: precision 1, 1, 3/4 at the
    # three OoD examples.
    assert metrics["aupr"] == pytest.approx((1 + 1 + 3 / 4) / 3)
    # Catching all 3 OoD examples (>= 95%) means flagging certainty <= 0.6,
    # which also flags the in-distribution 0.4: 1 of 4.
    assert metrics["fpr_at_95_tpr"] == pytest.approx(0.25)


def test_ood_metrics_match_sklearn():
    rng = np.random.default_rng(0)
    in_certainty = rng.normal(1.0, 1.0, 500)
    ood_certainty = rng.normal(0.0, 1.0, 300)
    metrics = keras_duq.evaluation.ood_metrics(in_certainty, ood_certainty)
    is_ood = np.r_[np.zeros(500), np.ones(300)]
    uncertainty = -np.r_[in_certainty, ood_certainty]
    assert metrics["auroc"] == pytest.approx(
        sk_metrics.roc_auc_score(is_ood, uncertainty)
    )
    assert metrics["aupr"] == pytest.approx(
        sk_metrics.average_precision_score(is_ood, uncertainty)
    )
    # FPR at 95% TPR by brute force over every threshold.
    best = min(
        np.mean(in_certainty <= t)
        for t in np.r_[in_certainty, ood_certainty]
        if np.mean(ood_certainty <= t) >= 0.95
    )
    assert metrics["fpr_at_95_tpr"] == pytest.approx(best)


def test_good_detector_scores_high_not_low():
    """Catches a flipped sign: confident in-distribution must give AUROC ~1."""
    rng = np.random.default_rng(1)
    in_certainty = rng.uniform(0.7, 1.0, 200)  # like DUQ on its training data
    ood_certainty = rng.uniform(0.0, 0.3, 200)  # far from every centroid
    metrics = keras_duq.evaluation.ood_metrics(in_certainty, ood_certainty)
    assert metrics == {"auroc": 1.0, "aupr": 1.0, "fpr_at_95_tpr": 0.0}
    flipped = keras_duq.evaluation.ood_metrics(ood_certainty, in_certainty)
    assert flipped["auroc"] == 0.0
    assert flipped["fpr_at_95_tpr"] == 1.0


def test_fpr_at_exactly_95_percent_tpr():
    # 20 OoD examples: catching 19 of them is exactly 95%, which suffices;
    # catching all 20 would also flag the in-distribution 0.185.
    ood_certainty = np.arange(20) / 100
    in_certainty = np.array([0.185, 0.5, 0.6, 0.7])
    metrics = keras_duq.evaluation.ood_metrics(in_certainty, ood_certainty)
    assert metrics["fpr_at_95_tpr"] == 0.0


def test_ood_metrics_ties_are_chance():
    metrics = keras_duq.evaluation.ood_metrics([0.5, 0.5], [0.5, 0.5])
    assert metrics["auroc"] == 0.5
    assert metrics["fpr_at_95_tpr"] == 1.0


@pytest.mark.parametrize(
    "in_certainty, ood_certainty, match",
    [
        (np.ones((3, 2)), np.ones(3), "certainty_scores"),
        (np.ones(3), [], "non-empty"),
        (np.ones(3), [np.inf], "infinite"),
    ],
)
def test_ood_metrics_reject_bad_input(in_certainty, ood_certainty, match):
    with pytest.raises(ValueError, match=match):
        keras_duq.evaluation.ood_metrics(in_certainty, ood_certainty)


# ---------------------------------------------------- misclassification_auroc


def test_misclassification_auroc_by_hand():
    certainty = [0.9, 0.4, 0.5, 0.2]
    correct = [True, True, False, False]
    # Correct above wrong in 3 of the 4 (correct, wrong) pairs.
    assert keras_duq.evaluation.misclassification_auroc(certainty, correct) == 0.75
    assert keras_duq.evaluation.misclassification_auroc(certainty, [1, 1, 0, 0]) == 0.75


def test_misclassification_auroc_matches_sklearn():
    rng = np.random.default_rng(2)
    correct = rng.random(400) < 0.8
    certainty = rng.normal(correct.astype(float), 1.0)
    assert keras_duq.evaluation.misclassification_auroc(
        certainty, correct
    ) == pytest.approx(sk_metrics.roc_auc_score(correct, certainty))


@pytest.mark.parametrize(
    "correct, match",
    [
        ([True, True, True], "all predictions are correct"),
        ([True, False], r"shape \(3,\)"),
        ([0, 2, 1], "booleans"),
    ],
)
def test_misclassification_auroc_rejects_bad_input(correct, match):
    with pytest.raises(ValueError, match=match):
        keras_duq.evaluation.misclassification_auroc([0.1, 0.2, 0.3], correct)


# ------------------------------------------------------------ rejection_curve


def test_rejection_curve_by_hand():
    # Pooled, least certain first: 0.1 OoD, 0.3 wrong, 0.6 right, 0.7 OoD,
    # 0.8 right, 0.9 right. 3 of the 6 are right.
    curve = keras_duq.evaluation.rejection_curve(
        in_certainty=[0.9, 0.8, 0.3, 0.6],
        in_correct=[True, True, False, True],
        ood_certainty=[0.1, 0.7],
        num_points=7,
    )
    np.testing.assert_allclose(curve["rejected_fraction"], np.arange(7) / 6)
    np.testing.assert_allclose(
        curve["accuracy"], [3 / 6, 3 / 5, 3 / 4, 2 / 3, 2 / 2, 1 / 1, np.nan]
    )
    # The oracle rejects the 3 wrong ones first, then keeps 100%.
    np.testing.assert_allclose(
        curve["oracle_accuracy"], [3 / 6, 3 / 5, 3 / 4, 1, 1, 1, np.nan]
    )


def test_rejection_curve_without_ood_starts_at_accuracy():
    curve = keras_duq.evaluation.rejection_curve(
        [0.2, 0.9, 0.8, 0.7], [0, 1, 1, 1], num_points=5
    )
    np.testing.assert_allclose(curve["accuracy"], [0.75, 1, 1, 1, np.nan])


def test_rejection_curve_splits_ties_evenly():
    # Rejecting one of two equally certain examples (one right, one wrong)
    # keeps half a right one on average, not whichever sorts first.
    curve = keras_duq.evaluation.rejection_curve(
        [0.5, 0.5], [True, False], num_points=3
    )
    np.testing.assert_allclose(curve["accuracy"], [0.5, 0.5, np.nan])
    curve = keras_duq.evaluation.rejection_curve(
        [0.5, 0.5], [False, True], num_points=3
    )
    np.testing.assert_allclose(curve["accuracy"], [0.5, 0.5, np.nan])


def test_rejection_curve_never_beats_oracle():
    rng = np.random.default_rng(3)
    correct = rng.random(300) < 0.9
    curve = keras_duq.evaluation.rejection_curve(
        rng.random(300), correct, ood_certainty=rng.random(100)
    )
    assert len(curve["accuracy"]) == 101
    assert np.all(curve["accuracy"][:-1] <= curve["oracle_accuracy"][:-1] + 1e-12)


def test_rejection_curve_rejects_bad_num_points():
    with pytest.raises(ValueError, match="num_points"):
        keras_duq.evaluation.rejection_curve([0.5], [True], num_points=1)


# ---------------------------------------------------------- OODEvaluation


def _moons(n, seed):
    x, y = sk_datasets.make_moons(n, noise=0.1, random_state=seed)
    return x.astype("float32"), y.astype("int32")


def _far_points(n, seed):
    # Points well away from both moons: out of distribution.
    rng = np.random.default_rng(seed)
    return rng.uniform(6.0, 8.0, (n, 2)).astype("float32")


def test_callback_logs_land_in_history_duq():
    keras.utils.set_random_seed(0)
    x_train, y_train = _moons(256, 0)
    x_test, y_test = _moons(128, 1)
    backbone = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(16, activation="relu")]
    )
    model = keras_duq.wrap(backbone, num_classes=2, length_scale=0.3)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    evaluation = keras_duq.callbacks.OODEvaluation(
        in_distribution=(x_test, y_test),
        out_of_distribution=_far_points(64, 2),
        every_n_epochs=2,
    )
    seen = []
    history = model.fit(
        x_train,
        y_train,
        epochs=3,
        batch_size=64,
        verbose=0,
        # A later callback sees the new values, as TensorBoard does.
        callbacks=[
            evaluation,
            keras.callbacks.LambdaCallback(
                on_epoch_end=lambda epoch, logs: seen.append(dict(logs))
            ),
        ],
    )
    keys = [
        "ood_auroc",
        "ood_aupr",
        "ood_fpr_at_95_tpr",
        "ood_in_distribution_accuracy",
        "ood_misclassification_auroc",
    ]
    # Evaluated after epoch 2 (every_n_epochs) and epoch 3 (the last).
    assert evaluation.history["epoch"] == [1, 2]
    for key in keys:
        assert len(history.history[key]) == 2, key
        assert history.history[key] == evaluation.history[key]
    # The logged values are those of the final weights, recomputed here.
    final = evaluation.evaluate()
    for key in keys:
        assert history.history[key][-1] == pytest.approx(final[key]), key
    assert "ood_auroc" not in seen[0]
    assert seen[2]["ood_auroc"] == history.history["ood_auroc"][-1]


def test_callback_csv_logger_every_epoch(tmp_path):
    x_train, y_train = _moons(64, 0)
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(2, activation="softmax")]
    )
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    csv_path = tmp_path / "log.csv"
    callbacks = [
        keras_duq.callbacks.OODEvaluation(
            x_train, _far_points(32, 1), every_n_epochs=1
        ),
        keras.callbacks.CSVLogger(str(csv_path)),
    ]
    history = model.fit(x_train, y_train, epochs=2, verbose=0, callbacks=callbacks)
    with open(csv_path) as file:
        rows = list(csv.DictReader(file))
    assert [float(row["ood_auroc"]) for row in rows] == pytest.approx(
        history.history["ood_auroc"]
    )


def test_callback_with_softmax_model_and_datasets():
    keras.utils.set_random_seed(0)
    x_train, y_train = _moons(256, 0)
    x_test, y_test = _moons(100, 1)
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    # A shuffled labelled dataset: scores and labels must stay paired.
    in_distribution = (
        tf.data.Dataset.from_tensor_slices((x_test, y_test)).shuffle(100).batch(32)
    )
    out_of_distribution = tf.data.Dataset.from_tensor_slices(_far_points(50, 2))
    out_of_distribution = out_of_distribution.batch(32)
    evaluation = keras_duq.callbacks.OODEvaluation(
        in_distribution,
        out_of_distribution,
        every_n_epochs=1,
        method="negative_entropy",
        prefix="mnist_",
    )
    history = model.fit(
        x_train, y_train, epochs=2, batch_size=64, verbose=0, callbacks=[evaluation]
    )
    for key in ("mnist_auroc", "mnist_aupr", "mnist_fpr_at_95_tpr"):
        assert len(history.history[key]) == 2
    # The paired accuracy matches a plain evaluation of the same data.
    predictions = model.predict(x_test, verbose=0).argmax(axis=1)
    assert history.history["mnist_in_distribution_accuracy"][-1] == pytest.approx(
        np.mean(predictions == y_test)
    )


class _Batches(keras.utils.PyDataset):
    """A user's own PyDataset, defined only by `__len__` and `__getitem__`."""

    def __init__(self, x, y=None, batch_size=16):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows] if self.y is None else (self.x[rows], self.y[rows])


def test_callback_with_py_datasets_matches_arrays():
    keras.utils.set_random_seed(0)
    x_test, y_test = _moons(100, 1)
    x_ood = _far_points(50, 2)
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )
    from_arrays = keras_duq.callbacks.OODEvaluation((x_test, y_test), x_ood)
    from_arrays.set_model(model)
    for in_distribution in (
        _Batches(x_test, y_test),
        # What `make_dataset` returns without TensorFlow, shuffled.
        keras_duq.datasets._ArrayBatches((x_test, y_test), 32, (True, 0, False)),
    ):
        from_batches = keras_duq.callbacks.OODEvaluation(
            in_distribution, _Batches(x_ood)
        )
        from_batches.set_model(model)
        assert from_batches.evaluate() == pytest.approx(
            from_arrays.evaluate(), nan_ok=True
        )

    endless = keras_duq.datasets._ArrayBatches((x_ood, None), 128, (False, None, True))
    with pytest.raises(ValueError, match="endless"):
        keras_duq.callbacks.OODEvaluation(x_test, endless)


def test_callback_without_labels_logs_only_ood_metrics():
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(3, activation="softmax")]
    )
    evaluation = keras_duq.callbacks.OODEvaluation(_moons(40, 0)[0], _far_points(40, 1))
    evaluation.set_model(model)
    assert set(evaluation.evaluate()) == {"ood_auroc", "ood_aupr", "ood_fpr_at_95_tpr"}


def test_callback_with_tensorboard_after_it(tmp_path):
    pytest.importorskip("tensorboard")
    x_train, y_train = _moons(64, 0)
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(2, activation="softmax")]
    )
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    callbacks = [
        keras_duq.callbacks.OODEvaluation(
            x_train, _far_points(32, 1), every_n_epochs=1
        ),
        keras.callbacks.TensorBoard(str(tmp_path)),
    ]
    model.fit(x_train, y_train, epochs=1, verbose=0, callbacks=callbacks)
    tags = set()
    for path in (tmp_path / "train").glob("events.out.tfevents.*"):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            tags.update(value.tag for value in event.summary.value)
    assert "epoch_ood_auroc" in tags


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_epochs": 0}, "every_n_epochs"),
        ({"method": "entropy"}, "method"),
        ({"in_distribution": (np.ones((3, 2)), np.ones(2))}, "labels"),
        ({"in_distribution": (np.ones((3, 2)),)}, "tuple of length 1"),
        ({"out_of_distribution": "mnist"}, "type str"),
    ],
)
def test_callback_rejects_bad_arguments(kwargs, match):
    arguments = {
        "in_distribution": np.ones((3, 2)),
        "out_of_distribution": np.ones((3, 2)),
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        keras_duq.callbacks.OODEvaluation(**arguments)


# ------------------------------------------------------------ calibration


def _reference_ece(confidence, correct, edges):
    """Textbook ECE, bin by bin: sum of (n_bin / n) * |accuracy - confidence|."""
    total = 0.0
    for index in range(len(edges) - 1):
        low = -np.inf if index == 0 else edges[index]
        high = np.inf if index == len(edges) - 2 else edges[index + 1]
        in_bin = (confidence > low) & (confidence <= high)
        if in_bin.any():
            gap = abs(np.mean(correct[in_bin]) - np.mean(confidence[in_bin]))
            total += in_bin.sum() / len(confidence) * gap
    return total


@pytest.mark.parametrize("seed, num_bins", [(0, 15), (1, 10), (2, 1), (3, 40)])
def test_expected_calibration_error_matches_textbook_definition(seed, num_bins):
    rng = np.random.default_rng(seed)
    confidence = rng.beta(5, 2, size=1000)
    correct = rng.random(1000) < confidence**2
    uniform = keras_duq.evaluation.expected_calibration_error(
        confidence, correct, num_bins=num_bins
    )
    expected = _reference_ece(confidence, correct, np.linspace(0, 1, num_bins + 1))
    assert uniform == pytest.approx(expected, abs=1e-6)
    quantile = keras_duq.evaluation.expected_calibration_error(
        confidence, correct, num_bins=num_bins, strategy="quantile"
    )
    edges = np.quantile(confidence, np.linspace(0, 1, num_bins + 1))
    assert quantile == pytest.approx(
        _reference_ece(confidence, correct, edges), abs=1e-6
    )


def test_expected_calibration_error_by_hand():
    # Bin (0.5, 1]: accuracy 1/2, confidence 0.9; bin [0, 0.5]: 0 and 0.1.
    ece = keras_duq.evaluation.expected_calibration_error(
        [0.9, 0.9, 0.1, 0.1], [1, 0, 0, 0], num_bins=2
    )
    assert ece == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)
    calibrated = keras_duq.evaluation.expected_calibration_error(
        [0.75] * 4 + [0.0] * 3, [1, 1, 1, 0, 0, 0, 0]
    )
    assert calibrated == pytest.approx(0.0)


def test_calibration_curve_bins():
    confidence = np.array([0.0, 0.2, 0.5, 0.5, 0.55, 1.0])
    curve = keras_duq.evaluation.calibration_curve(
        confidence, [0, 1, 1, 0, 1, 1], num_bins=4
    )
    np.testing.assert_allclose(curve["bin_edges"], [0, 0.25, 0.5, 0.75, 1])
    # Closed on the right: 0.5 falls in (0.25, 0.5], 0 in the first bin.
    np.testing.assert_array_equal(curve["count"], [2, 2, 1, 1])
    np.testing.assert_allclose(curve["accuracy"], [0.5, 0.5, 1, 1])
    np.testing.assert_allclose(curve["confidence"], [0.1, 0.5, 0.55, 1.0])

    rng = np.random.default_rng(0)
    quantile = keras_duq.evaluation.calibration_curve(
        rng.random(300), rng.random(300) < 0.5, num_bins=6, strategy="quantile"
    )
    np.testing.assert_array_equal(quantile["count"], [50] * 6)
    empty = keras_duq.evaluation.calibration_curve([0.9, 0.95], [1, 0], num_bins=4)
    assert np.isnan(empty["accuracy"][:3]).all() and empty["count"][3] == 2


@pytest.mark.parametrize(
    "confidence, kwargs, match",
    [
        ([0.5, 1.5], {}, r"in \[0, 1\]"),
        ([0.5, -0.1], {}, r"in \[0, 1\]"),
        ([0.5, np.nan], {}, "NaN"),
        ([0.5, 0.6], {"strategy": "equal"}, "strategy='equal'"),
        ([0.5, 0.6], {"num_bins": 0}, "num_bins"),
        ([[0.5, 0.6]], {}, "1-D"),
    ],
)
def test_calibration_rejects_bad_input(confidence, kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_duq.evaluation.expected_calibration_error(confidence, [1, 0], **kwargs)


# ------------------------------------------------------------ risk and coverage


def test_risk_coverage_by_hand():
    curve = keras_duq.evaluation.risk_coverage_curve([0.9, 0.6, 0.7, 0.8], [1, 0, 1, 0])
    np.testing.assert_allclose(curve["coverage"], [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(curve["risk"], [0, 1 / 2, 1 / 3, 1 / 2])
    assert keras_duq.evaluation.aurc([0.9, 0.6, 0.7, 0.8], [1, 0, 1, 0]) == (
        pytest.approx((0 + 1 / 2 + 1 / 3 + 1 / 2) / 4)
    )
    assert keras_duq.evaluation.risk_at_coverage(
        [0.9, 0.6, 0.7, 0.8], [1, 0, 1, 0], coverage=0.5
    ) == pytest.approx(0.5)


def test_risk_coverage_splits_ties_evenly():
    # One of the two tied examples is accepted at coverage 2/3: half right.
    curve = keras_duq.evaluation.risk_coverage_curve([0.9, 0.5, 0.5], [1, 1, 0])
    np.testing.assert_allclose(curve["risk"], [0, 0.25, 1 / 3])
    assert keras_duq.evaluation.aurc([0.5, 0.5], [True, False]) == pytest.approx(0.5)
    assert keras_duq.evaluation.aurc([0.5, 0.5], [False, True]) == pytest.approx(0.5)


def test_risk_coverage_mirrors_rejection_curve():
    rng = np.random.default_rng(0)
    certainty = np.round(rng.random(200), 1)  # many ties
    correct = rng.random(200) < certainty
    curve = keras_duq.evaluation.risk_coverage_curve(certainty, correct)
    rejection = keras_duq.evaluation.rejection_curve(certainty, correct, num_points=201)
    np.testing.assert_allclose(
        curve["risk"][::-1], 1 - rejection["accuracy"][:-1], atol=1e-12
    )


def test_aurc_best_when_errors_are_least_certain():
    correct = np.array([1, 1, 1, 0, 0], bool)
    best = keras_duq.evaluation.aurc([0.9, 0.8, 0.7, 0.2, 0.1], correct)
    worst = keras_duq.evaluation.aurc([0.1, 0.2, 0.3, 0.8, 0.9], correct)
    assert best == pytest.approx((0 + 0 + 0 + 1 / 4 + 2 / 5) / 5)
    assert worst > best


def test_risk_at_coverage_counts_the_rounded_fraction():
    # 0.9 * 10 is 9.000000000000002 in floating point: still 9 examples.
    certainty = np.arange(10) / 10
    correct = np.arange(10) > 0  # the least certain is the only error
    assert keras_duq.evaluation.risk_at_coverage(certainty, correct, 0.9) == 0.0
    assert keras_duq.evaluation.risk_at_coverage(certainty, correct, 1.0) == (
        pytest.approx(0.1)
    )
    # ceil(0.85 * 10) = 9 examples.
    assert keras_duq.evaluation.risk_at_coverage(certainty, correct, 0.85) == 0.0


@pytest.mark.parametrize("coverage", [0, 1.5, -0.1, True, "0.9"])
def test_risk_at_coverage_rejects_bad_coverage(coverage):
    with pytest.raises(ValueError, match="coverage"):
        keras_duq.evaluation.risk_at_coverage([0.5, 0.6], [1, 0], coverage=coverage)


# ------------------------------------------------------------ certainty_threshold


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.95, 0.999, 1.0])
def test_certainty_threshold_keeps_the_fraction(keep):
    rng = np.random.default_rng(0)
    for certainty in (
        rng.random(1000).astype("float32"),
        np.round(rng.random(997), 2),  # ties
        np.zeros(50),  # underflowed kernel values
    ):
        threshold = keras_duq.evaluation.certainty_threshold(certainty, keep=keep)
        assert np.mean(certainty >= threshold) >= keep
        # The largest such threshold: anything above keeps too few.
        assert np.mean(certainty > threshold) < keep
        assert threshold in certainty


def test_certainty_threshold_float32_round_trip():
    certainty = np.random.default_rng(1).random(1000).astype("float32")
    threshold = keras_duq.evaluation.certainty_threshold(certainty, keep=0.95)
    assert np.sum(certainty >= np.float32(threshold)) == 950


@pytest.mark.parametrize("keep", [0, 1.01, None])
def test_certainty_threshold_rejects_bad_keep(keep):
    with pytest.raises(ValueError, match="keep"):
        keras_duq.evaluation.certainty_threshold([0.5], keep=keep)


# ------------------------------------------------------------ CertaintyCalibrator


def _calibration_data(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    certainty = rng.random(n).astype("float32")
    return certainty, rng.random(n) < certainty**2


def test_calibrator_matches_sklearn_isotonic_regression():
    from sklearn.isotonic import IsotonicRegression

    certainty, correct = _calibration_data()
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(certainty, correct)
    assert calibrator.thresholds.dtype == np.float32
    assert calibrator.values.dtype == np.float32
    isotonic = IsotonicRegression(out_of_bounds="clip").fit(certainty, correct)
    query = np.concatenate(
        [certainty, np.random.default_rng(1).uniform(-0.5, 1.5, 3000).astype("float32")]
    )
    probability = calibrator(query)
    assert isinstance(probability, np.ndarray) and probability.shape == query.shape
    np.testing.assert_allclose(probability, isotonic.predict(query), atol=1e-6)


def test_calibrator_is_monotone_and_a_probability():
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(*_calibration_data())
    probability = calibrator(np.linspace(-1, 2, 20001, dtype="float32"))
    assert np.all(np.diff(probability) >= 0)
    assert probability.min() >= 0 and probability.max() <= 1
    # Wrong predictions sit at low certainty by construction (P = c**2).
    assert probability[0] < 0.05 and probability[-1] > 0.9


@pytest.mark.requires_backend("tensorflow")  # tf.function
def test_calibrator_in_tf_function_and_on_tensors():
    certainty, correct = _calibration_data()
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(certainty, correct)
    query = np.random.default_rng(2).random((7, 3)).astype("float32")

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def serve(x):
        return calibrator(x)

    traced = serve(tf.constant(query))
    assert isinstance(traced, tf.Tensor) and traced.shape == (7, 3)
    np.testing.assert_allclose(traced.numpy(), calibrator(query), atol=1e-7)
    eager = calibrator(keras.ops.convert_to_tensor(query, dtype="float16"))
    assert keras.ops.is_tensor(eager)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(eager), calibrator(query), atol=1e-3
    )


@pytest.mark.requires_backend("jax")  # in the JAX run, eager and jitted
def test_calibrator_on_jax_backend(tmp_path):
    import jax

    certainty, correct = _calibration_data()
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(certainty, correct)
    calibrator.save(tmp_path / "calibrator.json")
    loaded = keras_duq.evaluation.CertaintyCalibrator.load(tmp_path / "calibrator.json")
    query = np.linspace(-0.2, 1.2, 101, dtype="float32")
    eager = loaded(jax.numpy.asarray(query))
    jitted = jax.jit(lambda x: loaded(x))(jax.numpy.asarray(query))
    assert isinstance(eager, jax.Array) and isinstance(jitted, jax.Array)
    np.testing.assert_allclose(np.asarray(eager), calibrator(query), atol=1e-7)
    np.testing.assert_allclose(np.asarray(jitted), calibrator(query), atol=1e-7)


def test_calibrator_save_load_and_config_round_trip(tmp_path):
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(*_calibration_data())
    query = np.linspace(0, 1, 501, dtype="float32")
    path = tmp_path / "calibrator.json"
    calibrator.save(path)
    loaded = keras_duq.evaluation.CertaintyCalibrator.load(path)
    np.testing.assert_array_equal(loaded.thresholds, calibrator.thresholds)
    np.testing.assert_array_equal(loaded.values, calibrator.values)
    np.testing.assert_array_equal(loaded(query), calibrator(query))

    config = json.loads(json.dumps(calibrator.get_config()))
    rebuilt = keras_duq.evaluation.CertaintyCalibrator.from_config(config)
    np.testing.assert_array_equal(rebuilt(query), calibrator(query))
    serialized = keras.saving.serialize_keras_object(calibrator)
    deserialized = keras.saving.deserialize_keras_object(
        json.loads(json.dumps(serialized))
    )
    assert isinstance(deserialized, keras_duq.evaluation.CertaintyCalibrator)
    np.testing.assert_array_equal(deserialized(query), calibrator(query))


def test_calibrator_with_a_single_knot():
    calibrator = keras_duq.evaluation.CertaintyCalibrator(
        thresholds=[0.5], values=[0.7]
    )
    np.testing.assert_allclose(calibrator([0.0, 0.5, 1.0]), [0.7] * 3)


@pytest.mark.parametrize(
    "certainty, correct, match",
    [
        ([0.1, 0.9, 0.5], [0, 1], r"shape \(3,\)"),
        ([0.1, np.inf, 0.5], [0, 1, 1], "NaN or infinite"),
        ([0.1, 0.9, 0.5], [1, 1, 1], "all predictions are correct"),
        ([0.1, 0.9, 0.5], [0, 0, 0], "all predictions are wrong"),
        ([0.1, 0.9, 0.5], [0, 2, 1], "booleans or 0/1"),
    ],
)
def test_calibrator_fit_rejects_bad_input(certainty, correct, match):
    calibrator = keras_duq.evaluation.CertaintyCalibrator(
        thresholds=[0.5], values=[0.7]
    )
    with pytest.raises(ValueError, match=match):
        calibrator.fit(certainty, correct)
    # Nothing changed.
    np.testing.assert_array_equal(calibrator.thresholds, [0.5])


def test_calibrator_rejects_bad_state(tmp_path):
    unfitted = keras_duq.evaluation.CertaintyCalibrator()
    with pytest.raises(ValueError, match="not fitted"):
        unfitted([0.5])
    with pytest.raises(ValueError, match="Only a fitted"):
        unfitted.save(tmp_path / "c.json")
    with pytest.raises(ValueError, match="both `thresholds` and `values`"):
        keras_duq.evaluation.CertaintyCalibrator(thresholds=[0.5])
    with pytest.raises(ValueError, match="strictly increasing"):
        keras_duq.evaluation.CertaintyCalibrator(thresholds=[0.5, 0.5], values=[0, 1])
    with pytest.raises(ValueError, match="non-decreasing"):
        keras_duq.evaluation.CertaintyCalibrator(thresholds=[0.1, 0.5], values=[1, 0])
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="CertaintyCalibrator.save"):
        keras_duq.evaluation.CertaintyCalibrator.load(tmp_path / "other.json")


# ------------------------------------------- calibration from kernel values


def _kernel_values(n, seed, classes=4):
    """Kernel values whose mistakes come both from distance (a low largest
    value) and from ambiguity (two close classes), and the correctness."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    distance = rng.uniform(0.5, 6.0, n)  # -log of the largest kernel value
    margin = rng.exponential(1.0, n)  # log-space gap to the runner-up
    log_k = -distance[:, None] - margin[:, None] - rng.exponential(3.0, (n, classes))
    top = rng.integers(0, classes, n)
    log_k[np.arange(n), top] = -distance
    runner_up = (top + 1) % classes
    log_k[np.arange(n), runner_up] = -distance - margin
    # Right more often when close to a centroid and unambiguous.
    p_right = 1 / (1 + np.exp(-(2.0 - 0.5 * distance + 2.0 * margin)))
    correct = rng.uniform(size=n) < p_right
    return np.exp(log_k).astype("float32"), correct, labels


def test_calibrator_on_kernel_values_ranks_mistakes_better_than_certainty():
    # Over 5 seeds: fitted on one half, measured on the other.
    gains = []
    for seed in range(5):
        kernel_values, correct, _ = _kernel_values(4000, seed)
        fit, test = slice(0, 2000), slice(2000, None)
        calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(
            kernel_values[fit], correct[fit]
        )
        assert calibrator.takes_kernel_values
        probability = calibrator(kernel_values[test])
        assert probability.shape == (2000,) and probability.dtype == np.float32
        assert 0.0 <= probability.min() <= probability.max() <= 1.0
        certainty = kernel_values[test].max(axis=1)
        gains.append(
            keras_duq.evaluation.misclassification_auroc(probability, correct[test])
            - keras_duq.evaluation.misclassification_auroc(certainty, correct[test])
        )
        ece = keras_duq.evaluation.expected_calibration_error(probability, correct[test])
        assert ece < 0.05
    assert min(gains) > 0.02, gains


def test_calibrator_on_kernel_values_round_trips_and_runs_in_graphs(tmp_path):
    kernel_values, correct, _ = _kernel_values(500, 0)
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(kernel_values, correct)
    expected = calibrator(kernel_values)
    calibrator.save(tmp_path / "c.json")
    loaded = keras_duq.evaluation.CertaintyCalibrator.load(tmp_path / "c.json")
    np.testing.assert_array_equal(loaded(kernel_values), expected)
    config = calibrator.get_config()
    assert config["thresholds"] is None and len(config["weights"]) == 3
    rebuilt = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(calibrator)
    )
    np.testing.assert_array_equal(rebuilt(kernel_values), expected)
    # Kernel values that underflowed to 0 everywhere (far from every
    # centroid) and ties give finite probabilities.
    edge = np.array([[0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.1, 0.0]], "float32")
    assert np.isfinite(calibrator(edge)).all()
    assert calibrator(kernel_values[:0]).shape == (0,)
    with pytest.raises(ValueError, match="fitted on kernel values"):
        calibrator(kernel_values.max(axis=1))


def test_calibrator_saved_with_two_weights_uses_distance_and_second_margin():
    kernel_values, _, _ = _kernel_values(50, 0)
    calibrator = keras_duq.evaluation.CertaintyCalibrator(weights=[0.5, 2.0], bias=-1.0)
    log_kernel = np.log(np.sort(kernel_values.astype("float64"), axis=1)[:, ::-1])
    logit = 0.5 * log_kernel[:, 0] + 2.0 * (log_kernel[:, 0] - log_kernel[:, 1]) - 1.0
    np.testing.assert_allclose(
        calibrator(kernel_values), 1.0 / (1.0 + np.exp(-logit)), rtol=1e-5, atol=1e-6
    )
    assert "kernel values" in repr(calibrator)


@pytest.mark.requires_backend("tensorflow")
def test_calibrator_on_kernel_values_in_tf_function():
    kernel_values, correct, _ = _kernel_values(500, 0)
    calibrator = keras_duq.evaluation.CertaintyCalibrator().fit(kernel_values, correct)
    graph = tf.function(lambda k: calibrator(k))(tf.constant(kernel_values))
    np.testing.assert_allclose(
        graph.numpy(), calibrator(kernel_values), rtol=1e-6, atol=1e-7
    )


def test_calibrator_on_kernel_values_rejects_bad_input_unchanged():
    kernel_values, correct, _ = _kernel_values(50, 0)
    calibrator = keras_duq.evaluation.CertaintyCalibrator(thresholds=[0.5], values=[0.7])
    for scores, outcome, match in [
        (kernel_values[:, :1], correct, "two classes"),
        (np.where(np.arange(50)[:, None] == 3, np.nan, kernel_values), correct, "finite"),
        (kernel_values, correct[:10], "shape"),
        (kernel_values, np.ones(50, bool), "all predictions are correct"),
    ]:
        with pytest.raises(ValueError, match=match):
            calibrator.fit(scores, outcome)
        np.testing.assert_array_equal(calibrator.thresholds, [0.5])
        assert calibrator.weights is None


# ------------------------------------------------- conformal prediction sets


def test_conformal_threshold_by_hand():
    scores = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    labels = np.array([0, 1, 0, 0])  # true-class scores 0.9, 0.8, 0.6, 0.3
    # floor((4 + 1) * (1 - 0.6)) = 2: the second smallest, 0.6.
    assert keras_duq.evaluation.conformal_threshold(scores, labels, 0.6) == 0.6
    # floor(5 * 0.1) = 0: too few examples for 90%: every class.
    assert keras_duq.evaluation.conformal_threshold(scores, labels, 0.9) == -np.inf
    sets = keras_duq.evaluation.prediction_sets(scores, 0.6)
    np.testing.assert_array_equal(sets, [[1, 0], [0, 1], [1, 0], [0, 1]])
    metrics = keras_duq.evaluation.prediction_set_metrics(sets, labels)
    assert metrics == {"coverage": 0.75, "mean_size": 1.0, "empty": 0.0}


@pytest.mark.parametrize("coverage", [0.9, 0.95])
def test_conformal_sets_reach_their_coverage_over_random_splits(coverage):
    # Split conformal guarantees coverage >= target, and at most target +
    # 1 / (n + 1) in expectation for continuous scores: the mean over 200
    # random splits lies in that range, up to 4 standard errors.
    kernel_values, _, labels = _kernel_values(3000, 1, classes=5)
    rng = np.random.default_rng(7)
    coverages = []
    n = 500
    for _ in range(200):
        order = rng.permutation(len(labels))
        val, rest = order[:n], order[n:]
        t = keras_duq.evaluation.conformal_threshold(
            kernel_values[val], labels[val], coverage
        )
        sets = keras_duq.evaluation.prediction_sets(kernel_values[rest], t)
        coverages.append(
            keras_duq.evaluation.prediction_set_metrics(sets, labels[rest])["coverage"]
        )
    mean, error = np.mean(coverages), np.std(coverages) / np.sqrt(len(coverages))
    assert coverage - 4 * error <= mean <= coverage + 1 / (n + 1) + 4 * error


def test_prediction_sets_are_empty_far_from_every_centroid():
    kernel_values, _, labels = _kernel_values(1000, 2)
    t = keras_duq.evaluation.conformal_threshold(kernel_values, labels, 0.9)
    far = np.full((3, 4), 1e-30, "float32")
    assert not keras_duq.evaluation.prediction_sets(far, t).any()


@pytest.mark.parametrize(
    "scores, labels, coverage, match",
    [
        (np.ones((4, 2)), [0, 1, 0, 1], 1.0, "coverage"),
        (np.ones((4, 2)), [0, 1, 0, 1], 0, "coverage"),
        (np.ones(4), [0, 1, 0, 1], 0.9, "num_classes"),
        (np.ones((4, 2)), [0, 1, 0], 0.9, "shape"),
        (np.ones((4, 2)), [0, 1, 0, 2], 0.9, "class indices"),
        (np.ones((4, 2)), [0.5, 1, 0, 1], 0.9, "class indices"),
        (np.full((4, 2), np.nan), [0, 1, 0, 1], 0.9, "finite"),
    ],
)
def test_conformal_threshold_rejects_bad_input(scores, labels, coverage, match):
    with pytest.raises(ValueError, match=match):
        keras_duq.evaluation.conformal_threshold(scores, np.asarray(labels), coverage)


def test_risk_coverage_helpers_take_the_calibrated_probability():
    kernel_values, correct, _ = _kernel_values(1000, 3)
    probability = keras_duq.evaluation.CertaintyCalibrator().fit(
        kernel_values, correct
    )(kernel_values)
    assert 0 <= keras_duq.evaluation.aurc(probability, correct) <= 1
    curve = keras_duq.evaluation.risk_coverage_curve(probability, correct)
    assert len(curve["risk"]) == len(correct)
