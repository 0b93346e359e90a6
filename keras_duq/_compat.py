"""Every use of Keras's private internals in keras_duq, in this one module.

keras_duq uses public Keras APIs wherever they exist. Some behaviours have no
public hook, so they reach into Keras here, each looked up defensively: if a
private name moves in a future Keras, `import keras_duq` still works and the
behaviour degrades with one warning instead of failing.

1. `swap_batch_moments(function)`: Keras's TensorFlow backend computes the
   batch statistics of `BatchNormalization` and `GroupNormalization` in the
   module-level function `keras.src.backend.tensorflow.nn._compute_moments`.
   The gradient penalty needs them with exact second derivatives (see
   `_tensorflow_trainer.second_order_moments`). Degrades to: a second-order
   term missing from the penalty's gradient through those layers.
2. `MultiWorkerBuildMixin`: Keras (3.x, TensorFlow backend) builds a
   distributed model from one batch reduced with
   `strategy.reduce("MEAN", batch)`, which `MultiWorkerMirroredStrategy`
   rejects for any Keras model; the mixin overrides the private
   `Model._maybe_symbolic_build`. Degrades to: Keras's own build.
3. `mark_state_restored(model)`: Keras's JAX `fit` keeps the state
   outside the variables between steps and, in a `finally`, writes back the
   last state it saw. When a step raises (a bad batch), keras_duq has already
   put the unchanged state into the variables, and the state Keras holds was
   donated to the failed step; the flag tells Keras not to write it back.
   Degrades to: an error about deleted arrays after the clear one.
4. `array_dataset(...)`: Keras's own `tf.data` pipeline for in-memory arrays
   (`ArrayDataAdapter`, which shuffles indices and gathers batches), and
   `split_validation(...)`, the split behind `fit(validation_split=...)`, so
   that keras_duq can feed `fit` the same batches with `tf.data`'s
   autotuning off (see `_tensorflow_trainer._quiet_array_inputs`). Degrades
   to: Keras's own pipeline, whose whole `fit` can take up to twice its
   steps' time.
5. `all_layers(layer)`: every layer nested in `layer`, also inside a user's
   own `Layer` subclasses, which the public `Model.layers` does not list
   (`Layer._flatten_layers`). Degrades to: walking `.layers` only, so a
   training step would not keep the normalised kernel that a
   `SpectralNormalization` inside a custom layer writes.
6. `portable_config(config)`: on PyTorch, Keras's optimizers are classes of
   its private torch backend, and a `.keras` file names them by their
   module there; loading the file on TensorFlow or JAX would import PyTorch
   and build the torch class. Degrades to: nothing to rename, where a
   future Keras names them by their public name.
7. `purged_values_restored_on_failure(model)`: Keras's JAX loops empty the
   variables (`Variable._value`) for the length of a call; a call that
   fails before its first step leaves them empty. The values from before
   the call are put back into the variables still empty. Degrades to: no
   worse than Keras itself, if the attribute moves.
8. `uses_training_argument(layer)`: Keras's Functional models
   (`keras.src.models.functional.Functional`, which `keras.Model(inputs,
   outputs)` builds) take `training` only to pass it on. Degrades to: a
   training step computes the centroid update's features in an inference
   pass of its own, as for a backbone with Dropout (a forward pass more).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
import warnings

import keras

_MOMENTS_MODULE = "keras.src.backend.tensorflow.nn"
_MOMENTS_NAME = "_compute_moments"
_ARRAY_ADAPTER_MODULE = "keras.src.trainers.data_adapters.array_data_adapter"
_ARRAY_SLICING_MODULE = "keras.src.trainers.data_adapters.array_slicing"
_FLATTEN_LAYERS = "_flatten_layers"
_FUNCTIONAL_MODULE = "keras.src.models.functional"
_BACKEND_PREFIX = "keras.src.backend."

_lock = threading.Lock()
_depth = 0
_original = None
_warned = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _private_module(name, *attributes):
    """The module `name` if it imports and has every attribute, else None."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    return module if all(hasattr(module, a) for a in attributes) else None


def _moments_module():
    return _private_module(_MOMENTS_MODULE, _MOMENTS_NAME)


def _array_modules():
    adapter = _private_module(
        _ARRAY_ADAPTER_MODULE, "ArrayDataAdapter", "can_convert_arrays"
    )
    slicing = _private_module(_ARRAY_SLICING_MODULE, "train_validation_split")
    if adapter is None or slicing is None:
        _warn_once(
            "arrays",
            "keras_duq could not find Keras's data adapter for in-memory "
            f"arrays (`{_ARRAY_ADAPTER_MODULE}`), so `fit` with NumPy arrays "
            "uses Keras's own pipeline, which can wait for tf.data's "
            "autotuning after the last step. Pass "
            "`keras_duq.datasets.make_dataset(x, y, shuffle=True)` instead "
            "when training time matters.",
        )
        return None
    return adapter, slicing


def is_array_data(x, y=None, sample_weight=None):
    """Whether Keras would feed `(x, y, sample_weight)` as in-memory arrays."""
    modules = _array_modules() if x is not None else None
    return modules is not None and modules[0].can_convert_arrays((x, y, sample_weight))


def array_dataset(
    x,
    y=None,
    sample_weight=None,
    batch_size=None,
    steps=None,
    shuffle=False,
    class_weight=None,
):
    """Keras's `tf.data` pipeline for arrays, its batch count declared, autotuning off.

    Only call it where `is_array_data(x, y, sample_weight)` is true. The
    arguments mean what they mean in `fit`; class weights become sample
    weights here, as Keras does for arrays.
    """
    import tensorflow as tf

    adapter_module, _ = _array_modules()
    adapter = adapter_module.ArrayDataAdapter(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        steps=steps,
        shuffle=shuffle,
        class_weight=class_weight,
    )
    dataset = adapter.get_tf_dataset()
    # Keras's pipeline hides its length from tf.data (`flat_map`); declared,
    # `fit` shows the epoch's step count from the first epoch on.
    dataset = dataset.apply(
        tf.data.experimental.assert_cardinality(adapter.num_batches)
    )
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def split_validation(arrays, validation_split):
    """`fit(validation_split=...)`'s split of `arrays`: `(train, validation)`."""
    _, slicing = _array_modules()
    return slicing.train_validation_split(arrays, validation_split=validation_split)


def mark_state_restored(model):
    """Tells Keras's JAX trainer that the variables hold the current state."""
    if hasattr(model, "_jax_state_synced"):
        model._jax_state_synced = True
    else:
        _warn_once(
            "jax_state",
            "keras_duq could not find the JAX trainer's `_jax_state_synced`; "
            "after a rejected batch the model's variables may be unusable.",
        )


@contextlib.contextmanager
def purged_values_restored_on_failure(model):
    """On JAX, a failed call leaves the model's variables holding values.

    Keras's JAX loops take the variables' values out of them for the length
    of a call (`_purge_model_variables`) and put the newest state back when
    the call ends; a call that fails before its first step returns leaves
    them empty, and every later use of the model fails on `None`. JAX arrays
    are immutable, so keeping references to the values costs nothing: those
    still empty after a failure get their value from before the call. State
    that steps of this call produced and Keras put back stays.
    """
    if keras.backend.backend() != "jax":
        yield
        return
    variables = list(model.variables) + list(model.metrics_variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        variables += list(optimizer.variables)
    saved = [(variable, getattr(variable, "_value", None)) for variable in variables]
    try:
        yield
    except BaseException:
        for variable, value in saved:
            if getattr(variable, "_value", None) is None and value is not None:
                variable._value = value
        if hasattr(model, "_jax_state_synced"):
            model._jax_state = None
            model._jax_state_synced = True
        raise


def all_layers(layer):
    """`layer` and every layer nested in it, at any depth."""
    flatten = getattr(layer, _FLATTEN_LAYERS, None)
    if flatten is not None:
        return flatten(include_self=True, recursive=True)
    _warn_once(
        "layers",
        "keras_duq could not find Keras's `Layer._flatten_layers`; layers "
        "nested inside custom layers are not searched for "
        "SpectralNormalization, whose normalised kernels a training step keeps.",
    )
    found = [layer]
    for child in getattr(layer, "layers", ()):
        found.extend(all_layers(child))
    return found


def uses_training_argument(layer) -> bool:
    """Whether `layer`'s own `call` takes a `training` argument.

    Keras's Functional and Sequential models take one only to pass it on
    to their layers, Keras's `Dense` and `EinsumDense` take one and ignore
    it, and a `Dropout` of rate 0 is the identity in both modes: they count
    as not using it (a subclass that overrides `call` counts as using it).
    Where this Keras has no `Functional` class at
    `keras.src.models.functional`, Functional models count as using it, so
    that a training step computes the centroid update's features in a pass
    of its own, as it does for any layer that uses it.
    """
    if type(layer) is keras.layers.Dropout and layer.rate == 0:
        return False  # the identity in both modes
    passing_on = [
        keras.Sequential.call,
        keras.layers.Dense.call,
        keras.layers.EinsumDense.call,
    ]
    functional = _private_module(_FUNCTIONAL_MODULE, "Functional")
    if functional is not None:
        passing_on.append(functional.Functional.call)
    elif isinstance(layer, keras.Model):
        _warn_once(
            "functional",
            "keras_duq could not find Keras's Functional model class "
            f"(`{_FUNCTIONAL_MODULE}`); a training step computes the centroid "
            "update's features in a forward pass of its own.",
        )
    if type(layer).call in passing_on:
        return False
    return "training" in inspect.signature(layer.call).parameters


def batch_moments_supported() -> bool:
    """Whether this Keras computes batch moments where keras_duq can swap them."""
    return _moments_module() is not None


@contextlib.contextmanager
def swap_batch_moments(function):
    """Within the block, Keras's normalization layers use `function` for moments.

    `function(x, axes, keepdims)` must return the same values as Keras's own.
    Nested and concurrent blocks (one per replica under a distribution
    strategy) share one swap, undone when the last block exits.
    """
    global _depth, _original
    module = _moments_module()
    if module is None:
        _warn_once(
            "moments",
            "keras_duq could not find Keras's batch-moments function "
            f"(`{_MOMENTS_MODULE}.{_MOMENTS_NAME}`), so the gradient "
            "penalty's gradient through BatchNormalization and "
            "GroupNormalization misses a second-order term. Install a Keras "
            "version in the range keras_duq declares, or report this with "
            "your Keras version.",
        )
        yield
        return
    with _lock:
        if _depth == 0:
            _original = getattr(module, _MOMENTS_NAME)
            setattr(module, _MOMENTS_NAME, function)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                setattr(module, _MOMENTS_NAME, _original)
                _original = None


class MultiWorkerBuildMixin:
    """Model mixin: build under `MultiWorkerMirroredStrategy` from one replica's batch.

    Keras builds a distributed model from one batch reduced with
    `strategy.reduce("MEAN", batch)` (the whole `(x, y)` structure at once),
    which `MultiWorkerMirroredStrategy` rejects ("Attempt to convert a value
    (PerReplica...)"). Only the shapes matter for building, so under that
    strategy the first replica's part of the batch is used instead.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = getattr(self, "distribute_strategy", None)
        if iterator is not None and is_multi_worker(strategy):
            if _build_from_first_replica(self, iterator, strategy):
                return None
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)


def is_multi_worker(strategy):
    """Whether `strategy` is TensorFlow's `MultiWorkerMirroredStrategy`."""
    import keras

    if strategy is None or keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def _build_from_first_replica(model, iterator, strategy):
    """Builds `model` from the first replica's part of the iterator's first batch.

    Returns `False` (nothing done) when this Keras lacks the private build
    method, so the caller falls back to Keras's own build.
    """
    symbolic_build = getattr(model, "_symbolic_build", None)
    if symbolic_build is None:
        _warn_once(
            "build",
            "keras_duq could not find `Model._symbolic_build`; building a "
            "model under MultiWorkerMirroredStrategy falls back to Keras's "
            "own method.",
        )
        return False
    import keras

    for _, _, batches in iterator:
        data_batch = keras.tree.map_structure(
            lambda value: strategy.experimental_local_results(value)[0],
            next(batches),
        )
        break
    with strategy.scope():
        symbolic_build(data_batch=data_batch)
    return True


def portable_config(config):
    """`config` with backend-specific Keras classes named by their public name.

    On PyTorch, Keras's optimizers are subclasses in its torch backend
    (`keras.src.backend.torch.optimizers.torch_sgd.SGD`), and a `.keras`
    file names them so. Their public name (`keras.optimizers.SGD`) gives the
    current backend's class, with the same configuration and variables.
    """
    import keras

    if isinstance(config, list):
        return [portable_config(value) for value in config]
    if not isinstance(config, dict):
        return config
    config = {key: portable_config(value) for key, value in config.items()}
    module = config.get("module")
    if isinstance(module, str) and module.startswith(_BACKEND_PREFIX):
        if hasattr(keras.optimizers, config.get("class_name") or ""):
            config.update(module="keras.optimizers", registered_name=None)
    return config
