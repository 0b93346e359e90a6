"""Keras's private internals stay behind `keras_duq._compat`, and degrade safely."""

import re
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_duq
from keras_duq import _compat

PACKAGE = Path(keras_duq.__file__).parent
PRIVATE_KERAS = re.compile(
    r"keras\.src|_keras_history|_jit_compile|_loss_tracker|_symbolic_build|_compute_moments|_jax_state|_flatten_layers"
)


def test_private_keras_names_only_in_the_compat_module():
    offenders = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name != "_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_KERAS.search(line)
    ]
    assert not offenders, offenders


def test_an_optimizer_saved_on_pytorch_loads_as_the_public_class():
    # How Keras names an SGD optimizer in a `.keras` file written on PyTorch.
    saved = {
        "module": "keras.src.backend.torch.optimizers.torch_sgd",
        "class_name": "SGD",
        "config": {"learning_rate": 0.05, "momentum": 0.9},
        "registered_name": "SGD",
    }
    config = _compat.portable_config({"optimizer": saved, "loss": None})
    optimizer = keras.saving.deserialize_keras_object(config["optimizer"])
    assert type(optimizer) is type(keras.optimizers.SGD())
    assert optimizer.momentum == 0.9


@pytest.mark.requires_backend("tensorflow")  # a TensorFlow-only swap
def test_a_moved_moments_function_degrades_with_one_warning(monkeypatch):
    monkeypatch.setattr(_compat, "_MOMENTS_NAME", "_name_keras_no_longer_has")
    monkeypatch.setattr(_compat, "_warned", set())
    assert not _compat.batch_moments_supported()
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    features = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
    model = keras_duq.DUQModel(
        inputs, keras_duq.DUQOutput(2, length_scale=0.5)(features), gradient_penalty=1.0
    )
    model.compile(optimizer="sgd")
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    with pytest.warns(RuntimeWarning, match="second-order term"):
        history = model.fit(x, (x[:, 0] > 0).astype("int64"), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


@pytest.mark.requires_backend("tensorflow")  # arrays are fed so on TensorFlow only
def test_a_moved_array_adapter_degrades_to_keras_own_pipeline(monkeypatch):
    monkeypatch.setattr(_compat, "_ARRAY_ADAPTER_MODULE", "keras.src.no_such_module")
    monkeypatch.setattr(_compat, "_warned", set())
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = keras_duq.DUQModel(
        inputs, keras_duq.DUQOutput(2, length_scale=0.5)(keras.layers.Dense(8)(inputs))
    )
    model.compile(optimizer="sgd")
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    with pytest.warns(RuntimeWarning, match="make_dataset"):
        history = model.fit(
            x, (x[:, 0] > 0).astype("int64"), epochs=2, validation_split=0.25, verbose=0
        )
    assert len(history.history["val_loss"]) == 2
    assert model.predict(x, verbose=0).shape == (64, 2)


def test_all_layers_finds_layers_inside_custom_layers_and_degrades_to_public_layers(
    monkeypatch,
):
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.inner = keras.layers.Dense(4)

        def call(self, x):
            return self.inner(x)

    block = Block()
    nested = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    model = keras.Sequential([keras.Input((3,)), block, nested])
    found = _compat.all_layers(model)
    assert block.inner in found and nested.layers[0] in found

    monkeypatch.setattr(_compat, "_FLATTEN_LAYERS", "_name_keras_no_longer_has")
    monkeypatch.setattr(_compat, "_warned", set())
    with pytest.warns(RuntimeWarning, match="SpectralNormalization"):
        found = _compat.all_layers(model)
    assert nested.layers[0] in found and block in found
    assert block.inner not in found


def test_import_needs_neither_matplotlib_nor_scikit_learn():
    # Keras itself imports both when they are installed, so block them: the
    # core must import and train without them. Only importing fails: PyTorch
    # looks for them (`find_spec`) without importing them.
    from harness import run

    loaded = run("core_without_optional_packages.py", backend=keras.backend.backend())
    for namespace in ("evaluation", "plots", "datasets", "callbacks"):
        assert f"keras_duq.{namespace}" not in loaded, loaded


def test_plots_without_matplotlib_raise_an_actionable_error(monkeypatch):
    from keras_duq import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"keras-duq\[plots\]"):
        plots.plot_certainty_histograms(np.array([0.9, 0.8]), np.array([0.1, 0.2]))


def test_public_names_have_one_home_and_a_missing_one_names_the_submodules():
    with pytest.raises(AttributeError, match=r"'ood_metrics'.*keras_duq\.evaluation"):
        keras_duq.ood_metrics  # noqa: B018
    assert set(keras_duq.__all__) == {
        "DUQBatchError",
        "DUQModel",
        "DUQOutput",
        "wrap",
        "__version__",
        "DUQHealthWarning",
        "KernelUnderflowWarning",
        "LowCertaintyWarning",
        "PaddingWarning",
        "BatchNormStatisticsWarning",
        "CentroidWarning",
        "ConstantPenaltyWarning",
        "recompute_batch_norm_statistics",
        "SpectralNormalization",
        "spectral_normalize",
        "InputScaleWarning",
        "FeatureDropoutWarning",
        "PAPER_SETTINGS",
        "load_model",
    }


class _UsesTraining(keras.layers.Layer):
    def call(self, x, training=None):
        return x


class _OwnDense(keras.layers.Dense):
    def call(self, inputs, training=None):
        return super().call(inputs) * (2.0 if training else 1.0)


def test_layers_that_use_training_are_told_from_those_that_pass_it_on():
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    same = [
        keras.layers.Dense(3),
        keras.layers.EinsumDense("ab,bc->ac", output_shape=3),
        keras.layers.Dropout(0.0),
        keras.layers.Conv2D(3, 3),
        keras.Sequential([keras.layers.Dense(3)]),
        functional,
    ]
    different = [
        keras.layers.Dropout(0.5),
        keras.layers.BatchNormalization(),
        keras.layers.GaussianNoise(0.1),
        _UsesTraining(),
        _OwnDense(3),
    ]
    assert not any(_compat.uses_training_argument(layer) for layer in same)
    assert all(_compat.uses_training_argument(layer) for layer in different)


def test_without_keras_functional_class_a_step_takes_its_own_inference_pass(
    monkeypatch,
):
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    monkeypatch.setattr(_compat, "_FUNCTIONAL_MODULE", "keras.src.no_such_module")
    monkeypatch.setattr(_compat, "_warned", set())
    with pytest.warns(RuntimeWarning, match="Functional model class"):
        assert _compat.uses_training_argument(functional)
    assert not _compat.uses_training_argument(keras.layers.Dense(3))
