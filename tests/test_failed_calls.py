"""A failed `fit`, `evaluate` or `predict` leaves the model usable and unchanged.

Property-based: `hypothesis` generates bad data (input shapes, dtypes,
NaN/Inf placement, label values and widths, empty and ragged data) and each
case asserts a clear exception (a `ValueError`, never an internal
`UnboundLocalError`, `AttributeError` or `TypeError`), then that the model
still predicts and its weights, centroids and `optimizer.iterations` are
those from before the call. Runs under every backend (`KERAS_BACKEND`); the
number of cases tried is printed at the end of the run.
"""

import collections

import keras
import numpy as np
import pytest
from harness import assert_state_equal
from harness import state
from harness import tabular_data
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_duq

FEATURES, CLASSES = 8, 3
CASES = collections.Counter()
# Bounded, so that the suites stay within CI's time on every backend.
SETTINGS = settings(
    max_examples=12,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def model():
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu")]
    )
    model = keras_duq.wrap(backbone, num_classes=CLASSES)
    model.compile(optimizer="adam")
    x, y = _good(64)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return model


def _good(n, seed=0):
    return tabular_data(n, features=FEATURES, classes=CLASSES, seed=seed)


def _iterations(model):
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


def _assert_rejected_unchanged(model, call, kind):
    CASES[kind] += 1
    before = state(model, optimizer=True)
    with pytest.raises(ValueError):
        call()
    assert_state_equal(model, before, optimizer=True)
    x, _ = _good(4, seed=1)
    assert model.predict(x, verbose=0).shape == (4, CLASSES)


def _methods(model, x, y):
    return {
        "fit": lambda: model.fit(x, y, batch_size=16, verbose=0, shuffle=False),
        "evaluate": lambda: model.evaluate(x, y, batch_size=16, verbose=0),
        "train_on_batch": lambda: model.train_on_batch(x, y),
    }


bad_shapes = st.lists(st.integers(0, 10), min_size=0, max_size=4).filter(
    lambda shape: not (len(shape) == 2 and shape[1] == FEATURES and shape[0] > 0)
)


@SETTINGS
@given(shape=bad_shapes, method=st.sampled_from(["fit", "evaluate", "predict"]))
def test_bad_input_shapes(model, shape, method):
    x = np.zeros(shape, "float32")
    n = shape[0] if shape else 1
    y = np.zeros(n, "int64")
    calls = _methods(model, x, y)
    calls["predict"] = lambda: model.predict(x, verbose=0)
    _assert_rejected_unchanged(model, calls[method], "input shape")


@SETTINGS
@given(
    rows=st.lists(st.integers(0, 31), min_size=1, max_size=4, unique=True),
    column=st.integers(0, FEATURES - 1),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
    dtype=st.sampled_from(["float32", "float64", "float16"]),
    method=st.sampled_from(["fit", "evaluate", "train_on_batch"]),
)
def test_non_finite_inputs_in_training(model, rows, column, value, dtype, method):
    x, y = _good(32)
    x = x.astype(dtype)
    x[rows, column] = value
    _assert_rejected_unchanged(model, _methods(model, x, y)[method], "non-finite input")


@SETTINGS
@given(
    rows=st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_non_finite_inputs_predict_nan(model, rows, value):
    CASES["non-finite input, predict"] += 1
    x, _ = _good(16)
    x[rows, 0] = value
    before = state(model, optimizer=True)
    kernel_values = model.predict(x, verbose=0)
    assert np.isnan(kernel_values[rows]).all()
    others = np.setdiff1d(np.arange(16), rows)
    assert np.isfinite(kernel_values[others]).all()
    assert_state_equal(model, before, optimizer=True)


labels = st.one_of(
    st.integers(CLASSES, 1000).map(lambda v: ("int", v)),
    st.integers(-1000, -1).map(lambda v: ("int", v)),
    st.floats(0.01, CLASSES - 0.01)
    .filter(lambda v: v != int(v))
    .map(lambda v: ("float", v)),
    st.just(("float", float("nan"))),
)


@SETTINGS
@given(
    label=labels,
    index=st.integers(0, 31),
    method=st.sampled_from(["fit", "evaluate", "train_on_batch"]),
)
def test_bad_label_values(model, label, index, method):
    kind, value = label
    x, y = _good(32)
    y = y.astype("float32" if kind == "float" else "int64")
    y[index] = value
    _assert_rejected_unchanged(model, _methods(model, x, y)[method], "label value")


def _soft_rows(row):
    """One-hot rows that are not exactly one 1 and zeros."""
    return st.one_of(
        # Soft or smoothed: a distribution over the classes.
        st.floats(0.05, 0.95).map(lambda p: [p, 1 - p, 0.0]),
        st.floats(0.01, 0.3).map(lambda e: [1 - e, e / 2, e / 2]),
        st.just([1.0, 1.0, 0.0]),  # two classes
        st.just([0.0, 0.0, 0.0]),  # none
        st.just([2.0, -1.0, 0.0]),  # sums to 1, not binary
        st.just([float("nan"), 1.0, 0.0]),
    )


@SETTINGS
@given(
    row=_soft_rows(None),
    index=st.integers(0, 31),
    method=st.sampled_from(["fit", "evaluate", "train_on_batch"]),
)
def test_soft_or_bad_one_hot_rows(model, row, index, method):
    x, y = _good(32)
    one_hot = np.eye(CLASSES, dtype="float32")[y]
    one_hot[index] = row
    CASES["one-hot row"] += 1
    before = state(model, optimizer=True)
    expected = "NaN or infinite" if np.isnan(row).any() else "exactly one 1"
    with pytest.raises(ValueError, match=expected) as raised:
        _methods(model, x, one_hot)[method]()
    assert f"[{index}]" in str(raised.value) or method == "train_on_batch"
    assert_state_equal(model, before, optimizer=True)


@SETTINGS
@given(
    width=st.integers(2, 8).filter(lambda w: w != CLASSES),
    method=st.sampled_from(["fit", "evaluate", "train_on_batch"]),
)
def test_bad_label_widths(model, width, method):
    x, y = _good(32)
    one_hot = np.eye(width, dtype="float32")[y % width]
    _assert_rejected_unchanged(
        model, _methods(model, x, one_hot)[method], "label width"
    )


@SETTINGS
@given(method=st.sampled_from(["fit", "evaluate", "predict", "no labels"]))
def test_empty_and_missing_data(model, method):
    x, y = _good(32)
    calls = {
        "fit": lambda: model.fit(x[:0], y[:0], verbose=0),
        "evaluate": lambda: model.evaluate(x[:0], y[:0], verbose=0),
        "predict": lambda: model.predict(x[:0], verbose=0),
        "no labels": lambda: model.fit(x, verbose=0),
    }
    _assert_rejected_unchanged(model, calls[method], "empty or missing")


@SETTINGS
@given(lengths=st.lists(st.integers(1, 12), min_size=2, max_size=5, unique=True))
def test_ragged_inputs(model, lengths):
    x = [[0.0] * n for n in lengths]
    y = np.zeros(len(lengths), "int64")
    _assert_rejected_unchanged(
        model, lambda: model.fit(x, y, verbose=0), "ragged input"
    )


@SETTINGS
@given(dtype=st.sampled_from(["U3", "O"]))
def test_non_numeric_data(model, dtype):
    x, y = _good(8)
    calls = [
        lambda: model.fit(x, y.astype(dtype), verbose=0),
        lambda: model.predict(x.astype("U8"), verbose=0),
    ]
    for call in calls:
        _assert_rejected_unchanged(model, call, "non-numeric")


def test_bad_label_in_memory_raises_before_any_step(model):
    """One bad label at index 200: the call raises before its first step."""
    CASES["label value"] += 1
    x, y = _good(256)
    y[200] = 7
    before = state(model, optimizer=True)
    with pytest.raises(ValueError, match=r"y\[200\]=7"):
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert_state_equal(model, before, optimizer=True)


def test_stream_rejection_says_how_many_steps_were_applied(model):
    """A stream's bad batch changes nothing, and the message counts the steps before it."""
    CASES["stream"] += 1
    x, y = _good(256)
    y[200] = 7

    def batches():
        for start in range(0, 256, 32):
            yield x[start : start + 32], y[start : start + 32]

    before = _iterations(model)
    with pytest.raises(
        keras_duq.DUQBatchError, match=r"6 training step\(s\) of this `fit` call"
    ) as raised:
        model.fit(batches(), verbose=0)
    assert (raised.value.reason, raised.value.steps_applied) == ("label_range", 6)
    assert _iterations(model) == before + 6
    assert model.predict(x[:4], verbose=0).shape == (4, CLASSES)


def test_a_step_rejected_outside_fit_raises_the_typed_error(model):
    """`evaluate` on a stream, which the whole-call check does not read: the
    step's rejection gives its reason, with no step count."""
    CASES["stream"] += 1
    x, y = _good(32)
    x[3] = np.nan
    before = state(model, optimizer=True)

    def batches():
        yield x, y

    with pytest.raises(keras_duq.DUQBatchError) as raised:
        model.evaluate(batches(), verbose=0)
    assert raised.value.reason == "non_finite_input"
    assert raised.value.steps_applied is None
    assert_state_equal(model, before, optimizer=True)


def test_keras_error_in_a_stream_leaves_the_model_usable(model):
    """A batch of the wrong width in a generator: Keras's own error, a usable model."""
    CASES["stream"] += 1
    x, y = _good(64)

    def batches():
        yield np.zeros((8, FEATURES + 1), "float32"), y[:8]

    before = state(model, optimizer=True)
    with pytest.raises(Exception) as raised:
        model.fit(batches(), verbose=0)
    assert not isinstance(raised.value, (UnboundLocalError, AttributeError))
    assert_state_equal(model, before, optimizer=True)
    assert model.predict(x[:4], verbose=0).shape == (4, CLASSES)


@pytest.mark.slow
@pytest.mark.requires_backend("tensorflow")
@pytest.mark.parametrize("backend", ["tensorflow", "jax", "torch"])
def test_fit_killed_mid_epoch_resumes_with_backup_and_restore(tmp_path, backend):
    """SIGKILL in epoch 2, then the same `fit`: the model of an uninterrupted run."""
    import signal
    import subprocess
    import sys

    from harness import script_env
    from harness import script_path
    from harness import skip_unless_installed

    skip_unless_installed(backend)
    script, env = script_path("interrupted_fit.py"), script_env(backend)

    def run(*args):
        return subprocess.run(
            [sys.executable, script, *args], env=env, capture_output=True, text=True
        )

    backup = str(tmp_path / "backup")
    killed = run("kill", backup, str(tmp_path))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run("resume", backup, str(tmp_path))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, actual = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
    assert int(actual["iterations"]) == int(expected["iterations"]) == 18
    for name in expected.files:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6)


@SETTINGS
@given(
    key=st.one_of(
        st.integers(CLASSES, 100), st.integers(-100, -1), st.just("cat"), st.just(1.5)
    ),
    method=st.sampled_from(["fit", "bad weight"]),
)
def test_class_weight_names_a_class_that_exists(model, key, method):
    x, y = _good(32)
    class_weight = {key: 2.0} if method == "fit" else {0: float("nan")}
    CASES["class_weight"] += 1
    before = state(model, optimizer=True)
    expected = "names class" if method == "fit" else "finite number"
    with pytest.raises(ValueError, match=expected):
        model.fit(x, y, class_weight=class_weight, verbose=0)
    assert_state_equal(model, before, optimizer=True)


@SETTINGS
@given(
    form=st.sampled_from(["list", "str_", "bytes", "object"]),
    method=st.sampled_from(["fit", "evaluate", "predict"]),
)
def test_text_where_numbers_are_expected_names_the_fix(model, form, method):
    texts = [f"query number {i}" for i in range(8)]
    x = {
        "list": texts,
        "str_": np.array(texts),
        "bytes": np.array([t.encode() for t in texts]),
        "object": np.array(texts, dtype=object),
    }[form]
    y = np.arange(8) % CLASSES
    calls = {
        "fit": lambda: model.fit(x, y, verbose=0),
        "evaluate": lambda: model.evaluate(x, y, verbose=0),
        "predict": lambda: model.predict(x, verbose=0),
    }
    CASES["text input"] += 1
    before = state(model, optimizer=True)
    with pytest.raises(ValueError, match="TextVectorization"):
        calls[method]()
    assert_state_equal(model, before, optimizer=True)


def test_labels_as_python_lists_train_like_arrays(model):
    x, y = _good(32)
    before = state(model, optimizer=True)
    array_logs = model.evaluate(x, y, verbose=0, return_dict=True)
    list_logs = model.evaluate(x, y.tolist(), verbose=0, return_dict=True)
    assert list_logs["loss"] == pytest.approx(array_logs["loss"], rel=1e-6)
    assert_state_equal(model, before, optimizer=True)
    with pytest.raises(ValueError, match=r"class indices in \[0, 3\)") as raised:
        model.fit(x, [7] * 32, verbose=0)
    assert len(str(raised.value)) < 600  # names the label, not all of `x`


@pytest.mark.parametrize("shape", [(8, 5), (8, 4, 1), (4,)])
def test_dataset_of_the_wrong_input_shape_is_rejected_before_a_step(model, shape):
    tf = pytest.importorskip("tensorflow")
    x = np.zeros((32, *shape[1:]) if len(shape) > 1 else (32,), "float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, np.zeros(32, "int64")))
    if len(shape) > 1:
        dataset = dataset.batch(8)
    CASES["dataset spec"] += 1
    before = state(model, optimizer=True)
    with pytest.raises(ValueError, match="do not match the model's"):
        model.fit(dataset, verbose=0)
    assert_state_equal(model, before, optimizer=True)


@pytest.fixture(scope="module")
def saved_file(model, tmp_path_factory):
    """A saved model's bytes, and its predictions on `_good(4, seed=2)`."""
    path = tmp_path_factory.mktemp("saved") / "model.keras"
    model.save(path)
    x, _ = _good(4, seed=2)
    return path.read_bytes(), model.predict(x, verbose=0)


@settings(SETTINGS, max_examples=100)
@given(
    damage=st.sampled_from(["truncated", "corrupted"]),
    where=st.floats(0.0, 1.0, exclude_max=True),
)
def test_damaged_keras_files_are_named_as_damaged(saved_file, tmp_path, damage, where):
    CASES["damaged_file"] += 1
    data, predictions = saved_file
    data = bytearray(data)
    position = int(where * len(data))
    if damage == "truncated":
        data = data[:position]
    else:
        # Flip a run of bytes: inside a stored part, or in the zip's own records.
        end = min(len(data), position + 16)
        data[position:end] = bytes(b ^ 0xFF for b in data[position:end])
    path = tmp_path / f"{damage}_{position}.keras"
    path.write_bytes(bytes(data))
    try:
        loaded = keras_duq.load_model(path)
    except ValueError as error:
        message = str(error)
        assert "filepath=" in message and "Save the model again" in message, message
        return
    # Bytes the archive does not check (a timestamp, a file attribute): the
    # file must then load as the model it holds.
    x, _ = _good(4, seed=2)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), predictions, atol=1e-6)


def test_missing_keras_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.save"):
        keras_duq.load_model(tmp_path / "missing.keras")


def test_load_model_loads_a_whole_file(model, tmp_path):
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras_duq.load_model(path)
    x, _ = _good(8, seed=2)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )


def test_print_number_of_cases(capsys):
    """Prints how many bad-input cases this run tried (runs last in the file)."""
    with capsys.disabled():
        total = sum(CASES.values())
        print(f"\nfailed-call cases tried: {total} ({dict(CASES)})")
    assert total > 0
