"""The warnings a DUQ model gives about its own health: one class per cause."""

from __future__ import annotations


class DUQHealthWarning(UserWarning):
    """Base class of the warnings a `DUQModel` gives about its own health.

    Each cause warns once per model, naming the numbers and the fix.
    Silence them all, or one cause, with the `warnings` module.

    Example:

    ```python
    import warnings

    warnings.filterwarnings("ignore", category=keras_duq.DUQHealthWarning)
    warnings.filterwarnings("ignore", category=keras_duq.CentroidWarning)
    ```
    """


class KernelUnderflowWarning(DUQHealthWarning):
    """The kernel values of (nearly) every example underflow, in training or inference mode."""


class BatchNormStatisticsWarning(DUQHealthWarning):
    """Inference-mode features far from those of re-estimated BatchNormalization statistics."""


class CentroidWarning(DUQHealthWarning):
    """A centroid never received its class, or sits on another class's centroid."""


class ConstantPenaltyWarning(DUQHealthWarning):
    """The gradient penalty is constant: the input gradients are zero."""


class InputScaleWarning(DUQHealthWarning):
    """Floating-point inputs far from standardised, and no normalisation layer to fix it."""


class FeatureDropoutWarning(DUQHealthWarning):
    """The backbone's features come straight out of a dropout (or noise) layer."""


class PaddingWarning(DUQHealthWarning):
    """The backbone averages over padding, so its features encode each input's length."""


class LowCertaintyWarning(DUQHealthWarning):
    """In-distribution certainty far below any threshold one would choose by hand."""
