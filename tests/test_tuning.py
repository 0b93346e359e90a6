"""keras_duq.tuning.search: the paper's two-stage choice on validation data.

Tiny models and one epoch per trial: these tests check the API, the input
checks and the selection rules, which hold by construction on whatever the
trials measure. Whether the choice is good is measured on two moons by
research/benchmarks/tuning_two_moons.py (docs/tuning.md).
"""

import json
import logging
import math
import warnings

import keras
import numpy as np
import pytest

import keras_duq
from keras_duq import tuning

SEED = 3


def _blobs(n, seed):
    # Two overlapping Gaussian classes: about one validation prediction in
    # six is wrong, so the misclassification AUROC is defined.
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    x = rng.normal(size=(n, 2)) + np.where(y[:, None] == 1, 1.0, -1.0)
    return x.astype("float32"), y


X, Y = _blobs(256, 0)
X_VAL, Y_VAL = _blobs(256, 1)


def build_backbone():
    return keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(8),
        ]
    )


def _search(x=X, y=Y, validation_data=(X_VAL, Y_VAL), **kwargs):
    # Centroids that follow the features within a few steps (momentum 0.9),
    # so that two short epochs give models better than chance.
    arguments = dict(
        num_classes=2, epochs=2, batch_size=32, seed=SEED, verbose=0, momentum=0.9
    )
    arguments.update(kwargs)
    return tuning.search(
        build_backbone, x, y, validation_data=validation_data, **arguments
    )


@pytest.fixture(scope="module")
def user_model():
    """A model of the user's, built before the search."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    return model, model.predict(X[:8], verbose=0)


_TENSORFLOW_LOG = []


class _Recorder(logging.Handler):
    def emit(self, record):
        _TENSORFLOW_LOG.append(record.getMessage())


@pytest.fixture(scope="module")
def result(user_model):
    recorder = _Recorder()
    logging.getLogger("tensorflow").addHandler(recorder)
    try:
        yield _searched()
    finally:
        logging.getLogger("tensorflow").removeHandler(recorder)


def _searched():
    # Labels in the other accepted forms: (n, 1) and one-hot.
    return _search(
        y=Y[:, None],
        validation_data=(X_VAL, keras.utils.to_categorical(Y_VAL, 2)),
        length_scales=[0.1, 0.3, 1.0],
        gradient_penalties=[0.0, 0.1, 1.0],
        accuracy_tolerance=1.0,
        centroid_dims=4,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.5),
    )


def test_search_is_reached_from_the_package():
    assert keras_duq.tuning.search is tuning.search


def test_result_holds_every_trial(result):
    # Stage 1: one trial per length scale; stage 2: one per non-zero weight
    # (0 reuses stage 1's model at the chosen length scale).
    assert [t["stage"] for t in result.trials] == [1, 1, 1, 2, 2]
    assert [t["trial"] for t in result.trials] == [1, 2, 3, 4, 5]
    assert [t["length_scale"] for t in result.trials[:3]] == [0.1, 0.3, 1.0]
    assert all(t["gradient_penalty"] == 0.0 for t in result.trials[:3])
    assert [t["gradient_penalty"] for t in result.trials[3:]] == [0.1, 1.0]
    for trial in result.trials:
        assert set(trial) == {
            "trial",
            "stage",
            "length_scale",
            "gradient_penalty",
            "val_accuracy",
            "val_misclassification_auroc",
            "val_errors",
            "diverged",
            "seconds",
        }
        assert not trial["diverged"] and trial["seconds"] > 0
        assert 0.5 < trial["val_accuracy"] < 1.0
        assert trial["val_errors"] == round((1 - trial["val_accuracy"]) * len(Y_VAL))
        assert 0.0 <= trial["val_misclassification_auroc"] <= 1.0
    assert set(result.best) == {"length_scale", "gradient_penalty"}
    assert result.seed == SEED
    assert result.best_trial in result.trials
    json.dumps([result.best, result.trials])  # plain types
    summary = result.summary().splitlines()
    assert len(summary) == 6 and sum(line.endswith(" *") for line in summary) == 1


def test_stage_1_chooses_the_best_validation_accuracy(result):
    stage_1 = [t for t in result.trials if t["stage"] == 1]
    top = max(t["val_accuracy"] for t in stage_1)
    tied = [t for t in stage_1 if t["val_accuracy"] == top]
    # Ties go to the higher misclassification AUROC.
    expected = max(tied, key=lambda t: t["val_misclassification_auroc"])
    assert result.best["length_scale"] == expected["length_scale"]
    assert all(
        t["length_scale"] == expected["length_scale"]
        for t in result.trials
        if t["stage"] == 2
    )


def test_stage_2_chooses_the_best_misclassification_auroc(result):
    # With `accuracy_tolerance=1.0` every weight is eligible, 0 included
    # through stage 1's model at the chosen length scale.
    candidates = [
        t for t in result.trials if t["length_scale"] == result.best["length_scale"]
    ]
    assert sorted(t["gradient_penalty"] for t in candidates) == [0.0, 0.1, 1.0]
    expected = max(candidates, key=lambda t: t["val_misclassification_auroc"])
    assert result.best["gradient_penalty"] == expected["gradient_penalty"]


def test_a_trial_is_reproduced_from_its_seed(result):
    trial = result.best_trial
    keras.utils.set_random_seed(result.seed)
    # The initializer made after the seed: the search's copy of its own
    # instance drew from the trial's seed in the same way.
    model = keras_duq.wrap(
        build_backbone(),
        num_classes=2,
        centroid_dims=4,
        momentum=0.9,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.5),
        **result.best,
    )
    model.compile(optimizer=keras.optimizers.Adam())
    model.fit(X, Y, epochs=2, batch_size=32, verbose=0)
    accuracy = (model.predict(X_VAL, verbose=0).argmax(axis=1) == Y_VAL).mean()
    assert accuracy == trial["val_accuracy"]


def test_search_leaves_the_users_models_and_settings(result, user_model):
    model, before = user_model
    np.testing.assert_array_equal(model.predict(X[:8], verbose=0), before)
    assert keras.config.dtype_policy().name == "float32"
    assert not logging.getLogger("tensorflow").filters


def test_search_is_quiet_about_retracing(result):
    # Six models (the check's and five trials) each trace `predict` once,
    # which TensorFlow reports as retracing from the fifth on.
    assert not [message for message in _TENSORFLOW_LOG if "retracing" in message]


def _trial(gradient_penalty, accuracy, auroc, errors=40):
    return {
        "length_scale": 0.1,
        "gradient_penalty": gradient_penalty,
        "val_accuracy": accuracy,
        "val_misclassification_auroc": auroc,
        "val_errors": errors,
        "diverged": False,
    }


def test_stage_2_skips_weights_that_cost_accuracy():
    stage_1 = _trial(0.0, 0.90, 0.80)
    candidates = [_trial(0.1, 0.895, 0.85), _trial(1.0, 0.85, 0.95)]
    chosen = tuning._choose_gradient_penalty(candidates, stage_1, 0.01)
    assert chosen["gradient_penalty"] == 0.1
    chosen = tuning._choose_gradient_penalty(candidates, stage_1, 0.1)
    assert chosen["gradient_penalty"] == 1.0


def test_stage_2_warns_when_every_weight_costs_accuracy():
    stage_1 = _trial(0.0, 0.95, 0.80)
    candidates = [_trial(0.1, 0.90, 0.85), _trial(1.0, 0.85, 0.95)]
    with pytest.warns(UserWarning, match="cost more than `accuracy_tolerance`"):
        chosen = tuning._choose_gradient_penalty(candidates, stage_1, 0.01)
    assert chosen["gradient_penalty"] == 0.1


def test_stage_2_warns_when_the_auroc_is_undefined_or_coarse():
    stage_1 = _trial(0.0, 1.0, math.nan, errors=0)
    candidates = [_trial(0.1, 1.0, math.nan, 0), _trial(1.0, 1.0, math.nan, 0)]
    with pytest.warns(UserWarning, match="undefined for every penalty"):
        chosen = tuning._choose_gradient_penalty(candidates, stage_1, 0.01)
    assert chosen["gradient_penalty"] == 0.1  # ties: the smaller weight
    candidates = [_trial(0.1, 0.99, 0.7, 3), _trial(1.0, 0.99, 0.9, 3)]
    with pytest.warns(UserWarning, match="rests on 3 wrong validation"):
        chosen = tuning._choose_gradient_penalty(candidates, stage_1, 0.02)
    assert chosen["gradient_penalty"] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuning._choose_gradient_penalty([_trial(0.1, 0.99, 0.7)], stage_1, 0.02)


def test_diverged_trials_are_not_chosen():
    trials = [
        {**_trial(0.0, math.nan, math.nan, -1), "length_scale": 0.05, "diverged": True},
        {**_trial(0.0, 0.8, 0.7), "length_scale": 0.5},
    ]
    assert tuning._choose_length_scale(trials)["length_scale"] == 0.5
    with pytest.raises(RuntimeError, match="Every length scale"):
        tuning._choose_length_scale(trials[:1])


def test_training_that_diverges_everywhere_raises(capsys):
    with pytest.raises(RuntimeError, match="Every length scale.*non-finite"):
        _search(
            length_scales=[0.1],
            gradient_penalties=[0.1],
            optimizer=lambda: keras.optimizers.SGD(1e30),
            verbose=1,
        )
    assert (
        "Trial 1/2 (stage 1): length_scale=0.1, gradient_penalty=0: stopped "
        "at a non-finite step" in capsys.readouterr().out
    )


def test_max_trials_thins_default_grids_and_keeps_explicit_ones():
    assert tuning._grids(None, None, 4) == ([0.05, 1.0], [0.05, 1.0])
    assert tuning._grids(None, None, 5) == ([0.05, 0.2, 1.0], [0.05, 1.0])
    assert tuning._grids([0.2], None, 4) == ([0.2], [0.05, 0.2, 1.0])
    # A zero weight costs no trial.
    assert tuning._grids(None, [0.0, 0.5], 3) == ([0.05, 1.0], [0.0, 0.5])
    assert tuning._grids(None, None, None) == (
        list(tuning.DEFAULT_LENGTH_SCALES),
        list(tuning.DEFAULT_GRADIENT_PENALTIES),
    )


class _Counting:
    """A `build_backbone` that counts its calls."""

    calls = 0

    def __call__(self):
        self.calls += 1
        return build_backbone()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"length_scale": 0.1}, "chooses `length_scale`"),
        ({"gradient_penalty": 1.0}, "chooses `gradient_penalty`"),
        ({"lenght_scale": 0.1}, "Unknown argument"),
        ({"num_classes": 1}, "num_classes"),
        ({"validation_data": X_VAL}, "`validation_data` to be a tuple"),
        ({"validation_data": (X_VAL, Y_VAL[:10])}, r"validation_data\[1\]"),
        ({"validation_data": (X_VAL, Y_VAL + 1)}, r"class indices in \[0, 2\)"),
        ({"length_scales": []}, "`length_scales` to be a non-empty"),
        ({"length_scales": [0.0, 0.1]}, "`length_scales`.*> 0"),
        ({"length_scales": [0.1, 0.1]}, "repeats a value"),
        ({"gradient_penalties": [-1.0]}, "`gradient_penalties`.*>= 0"),
        ({"gradient_penalties": ["a"]}, "`gradient_penalties`"),
        (
            {
                "length_scales": [0.1, 0.3],
                "gradient_penalties": [0.1, 1],
                "max_trials": 3,
            },
            "need 4 trials",
        ),
        ({"length_scales": [0.1, 0.3], "max_trials": 2}, "leaving none"),
        ({"max_trials": 1}, "max_trials"),
        ({"epochs": 0}, "epochs"),
        ({"batch_size": 1.5}, "batch_size"),
        ({"optimizer": keras.optimizers.Adam()}, "`optimizer` to be a callable"),
        ({"optimizer": lambda: "adam"}, "return a new Keras optimizer"),
        ({"accuracy_tolerance": 2.0}, "accuracy_tolerance"),
        ({"seed": -1}, "seed"),
        ({"verbose": 3}, "verbose"),
        ({"centroid_dims": 0}, "centroid_dims"),
    ],
)
def test_bad_arguments_raise_before_training(kwargs, match):
    build = _Counting()
    arguments = dict(validation_data=(X_VAL, Y_VAL), num_classes=2, epochs=1, verbose=0)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=match):
        tuning.search(build, X, Y, **arguments)
    # At most the one model built to check the backbone and `wrap`'s
    # arguments: no trial started.
    assert build.calls <= 1


def test_bad_data_raise_before_training():
    build = _Counting()
    with pytest.raises(ValueError, match="`y` to hold one label per example"):
        tuning.search(build, X, Y[:-1], validation_data=(X_VAL, Y_VAL), num_classes=2)
    x = X.copy()
    x[0, 0] = np.nan
    with pytest.raises(ValueError, match="`x` contains NaN"):
        tuning.search(build, x, Y, validation_data=(X_VAL, Y_VAL), num_classes=2)
    with pytest.raises(ValueError, match="function that returns a new backbone"):
        tuning.search(
            build_backbone(), X, Y, validation_data=(X_VAL, Y_VAL), num_classes=2
        )
    assert build.calls == 0


def test_a_backbone_returned_twice_is_refused():
    backbone = build_backbone()
    before = [np.array(weight) for weight in backbone.weights]
    with pytest.raises(ValueError, match="returned a backbone it had returned before"):
        tuning.search(
            lambda: backbone,
            X,
            Y,
            validation_data=(X_VAL, Y_VAL),
            num_classes=2,
            verbose=0,
        )
    # Refused before the first trial's training: the weights are untouched.
    for weight, value in zip(backbone.weights, before):
        np.testing.assert_array_equal(np.array(weight), value)
