"""Sums over the replicas of a `tf.distribute` strategy (a no-op elsewhere).

The centroid update sums its batch statistics over replicas before the
moving-average step, so every replica assigns the same state. JAX's and
PyTorch's steps see the global batch already.
"""

from __future__ import annotations

import keras


def replica_sum(*tensors):
    """`tensors`, each summed over the replicas in sync (as a tuple)."""
    if keras.backend.backend() != "tensorflow":
        return tensors
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return tensors
    return tuple(context.all_reduce(tf.distribute.ReduceOp.SUM, list(tensors)))
