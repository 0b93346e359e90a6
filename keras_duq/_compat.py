"""Every use of Keras's private internals in keras_duq, in this one module.

keras_duq uses public Keras APIs wherever they exist. Two behaviours have no
public hook, so they reach into Keras here, each looked up defensively: if a
private name moves in a future Keras, `import keras_duq` still works and the
behaviour degrades with one warning instead of failing.

1. `swap_batch_moments(function)`: Keras's TensorFlow backend computes the
   batch statistics of `BatchNormalization` and `GroupNormalization` in the
   module-level function `keras.src.backend.tensorflow.nn._compute_moments`.
   The gradient penalty needs them with exact second derivatives (see
   `_moments`). Degrades to: a second-order term missing from the penalty's
   gradient through those layers.
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
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings

_MOMENTS_MODULE = "keras.src.backend.tensorflow.nn"
_MOMENTS_NAME = "_compute_moments"

_lock = threading.Lock()
_depth = 0
_original = None
_warned = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _moments_module():
    try:
        module = importlib.import_module(_MOMENTS_MODULE)
    except ImportError:
        return None
    return module if hasattr(module, _MOMENTS_NAME) else None


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
