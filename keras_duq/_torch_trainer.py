"""The PyTorch part of DUQModel's training and evaluation steps.

Keras's PyTorch trainer calls each step eagerly, and keras_duq never has it
compiled (`torch.compile` does not differentiate twice). One training step:

1. Check the batch (`_trainer.check_batch`); a bad batch raises before
   anything runs.
2. `_trainer.objective` in training mode. With the penalty on, the input
   gradient of `sum_c K_c` comes from `torch.autograd.grad(...,
   create_graph=True)`, and the objective's gradient with respect to the
   weights differentiates through it (double backprop, exact through
   BatchNormalization: PyTorch differentiates Keras's batch moments
   exactly twice).
   The forward pass runs in a `keras.StatelessScope`: the layer state it
   writes (BatchNormalization's statistics) comes back as values. The
   centroid update is computed from features recomputed in inference mode.
3. Check: a step whose loss, gradients, layer writes or centroid update are
   not finite raises before anything is assigned, or, under a
   `LossScaleOptimizer`, is skipped with a lower scale.
4. Commit: layer state, optimizer step, centroids and metrics.
"""

from __future__ import annotations

import keras
import torch

from keras_duq import _trainer
from keras_duq import _validation


def _tensor_gradients(function, tensors):
    """Gradients of `function(tensors)[0]` that are themselves differentiable."""
    tensors = [t.detach().requires_grad_(True) for t in tensors]
    return _differentiable_gradients(lambda: function(tensors), tensors)


def _probe_gradients(function):
    """Gradients with respect to the zero probes of `function(probe)`."""
    probes = []

    def probe(tensor):
        zeros = torch.zeros_like(tensor, requires_grad=True)
        probes.append(zeros)
        return tensor + zeros

    return _differentiable_gradients(lambda: function(probe), probes)


def _differentiable_gradients(function, tensors):
    """`function()`'s value differentiated with respect to `tensors` (filled by then)."""
    with torch.enable_grad():
        value, aux = function()
        gradients = torch.autograd.grad(
            value, tensors, create_graph=True, allow_unused=True
        )
    return list(gradients), aux


_INPUT_GRADIENTS = _trainer.InputGradients(_tensor_gradients, _probe_gradients)


class TorchTrainer(_trainer.UncompiledSteps, _trainer.Trainer):
    """DUQModel's steps on Keras's PyTorch backend."""

    input_gradients = _INPUT_GRADIENTS

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, labels_one_hot, sample_weight, _ = self._checked_batch(x, y, sample_weight)
        batch = _trainer.Batch(x, y, labels_one_hot, sample_weight)
        weights = self.trainable_weights
        values = [weight.value for weight in weights]
        penalised = True
        if self._lazy_penalty:
            penalised = bool(self._is_penalty_step(self.optimizer.iterations))
        layer_state = self._layer_state()
        scale = self._input_gradient_scale()
        # Compute: nothing here assigns a variable; the layers' writes
        # (BatchNorm's statistics) come back as values.
        with torch.enable_grad(), keras.StatelessScope() as scope:
            total, (step_values, state) = self._own_objective(
                batch, training=True, weights=values, with_penalty=penalised
            )
            gradients = torch.autograd.grad(
                self.optimizer.scale_loss(total), values, allow_unused=True
            )
        writes = [
            None if value is None else value.detach()
            for value in _trainer.written_values(scope, layer_state)
        ]
        gradients = self._clipped(gradients, scale)
        with torch.no_grad():
            centroids = self._next_centroids(x, labels_one_hot, state.features)
        # Check.
        finite = _all_finite(gradients + [total] + writes)
        if not finite and self._uses_loss_scale():
            # It skips such a step itself and lowers the loss scale; nothing
            # else of the step is assigned.
            with torch.no_grad():
                self.optimizer.apply(gradients, weights)
            return self.get_metrics_result()
        self._raise(int(_trainer.step_error(finite, centroids.finite)))
        # Commit.
        with torch.no_grad():
            for variable, value in zip(layer_state, writes):
                if value is not None:
                    variable.assign(value)
            self.optimizer.apply(gradients, weights)
            self.duq_output._assign_centroid_state(centroids.values)
            self._update_duq_metrics(batch, _detached(step_values))
        return self.get_metrics_result()

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x, labels_one_hot, sample_weight, _ = self._checked_batch(x, y, sample_weight)
        batch = _trainer.Batch(x, y, labels_one_hot, sample_weight)
        _, (step_values, _) = self._own_objective(batch, training=False)
        with torch.no_grad():
            self._update_duq_metrics(batch, _detached(step_values))
        return self.get_metrics_result()

    # Prediction runs eagerly too (the steps: `UncompiledSteps`), so that a
    # model compiled where `jit_compile="auto"` means XLA (JAX) and loaded
    # here does not spend its first call compiling.

    def make_predict_function(self, force=False):
        return self._make_uncompiled(super().make_predict_function, force)

    def _checked_batch(self, x, y, sample_weight):
        checked = self._check_batch(x, y, sample_weight)
        self._raise(int(checked[-1]))
        return checked

    def _input_gradient_scale(self):
        if not self._uses_loss_scale():
            return None
        return self.optimizer.scale_loss(1.0).detach().float()

    def _raise(self, code):
        if code:
            raise _validation.batch_error(code, self.num_classes)


def _all_finite(tensors):
    # As `_ops.all_finite`, in one host transfer and without Keras's
    # per-op dispatch, which costs a call per tensor.
    checks = [
        torch.isfinite(t).all()
        for t in tensors
        if t is not None and t.is_floating_point()
    ]
    return bool(torch.stack(checks).all()) if checks else True


def _detached(values):
    """`values` (a `StepValues`) cut from the autograd graph, for the metrics."""
    return _trainer.StepValues(
        *(None if value is None else value.detach() for value in values)
    )
