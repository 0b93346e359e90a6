"""Health checks: a DUQ model watches its own failure modes and says so.

Four causes make DUQ's certainty meaningless without any error: kernel
values that underflow for (nearly) every example, BatchNormalization moving
statistics that have not settled (inference-mode features far from those
that re-estimated statistics give), centroids that never received their
class or that sit on another class's centroid, and a gradient penalty that
is constant because the input gradients are zero. Three more are seen at
the start of `fit`, before any step: inputs far from standardised, features
that come out of a dropout layer, and features averaged over padding. Each
warns once per model with a subclass of `DUQHealthWarning`, naming the
numbers and the fix.

The numbers are measured cheaply: per batch inside the training and test
steps, from tensors the step already has (logged as `certainty`, `underflow`
and `zero_input_gradient`), and once per epoch and per `evaluate` on a
sample of a few hundred inputs (`batch_norm_gap`, `centroid_overlap`).
"""

from keras_duq._health import rules
from keras_duq._health.callback import HealthCheck
from keras_duq._health.callback import sample_inputs
from keras_duq._health.callback import with_health_check
from keras_duq._health.checks import BatchHealth
from keras_duq._health.checks import ModeComparison
from keras_duq._health.checks import check_final_state
from keras_duq._health.checks import check_predictions
from keras_duq._health.checks import feature_noise_layer
from keras_duq._health.checks import out_of_distribution
from keras_duq._health.checks import state_of
from keras_duq._health.warning_types import BatchNormStatisticsWarning
from keras_duq._health.warning_types import CentroidWarning
from keras_duq._health.warning_types import ConstantPenaltyWarning
from keras_duq._health.warning_types import DUQHealthWarning
from keras_duq._health.warning_types import FeatureDropoutWarning
from keras_duq._health.warning_types import InputScaleWarning
from keras_duq._health.warning_types import KernelUnderflowWarning
from keras_duq._health.warning_types import LowCertaintyWarning
from keras_duq._health.warning_types import PaddingWarning

__all__ = [
    "BatchHealth",
    "BatchNormStatisticsWarning",
    "CentroidWarning",
    "ConstantPenaltyWarning",
    "DUQHealthWarning",
    "FeatureDropoutWarning",
    "HealthCheck",
    "InputScaleWarning",
    "KernelUnderflowWarning",
    "LowCertaintyWarning",
    "ModeComparison",
    "PaddingWarning",
    "check_final_state",
    "check_predictions",
    "feature_noise_layer",
    "out_of_distribution",
    "rules",
    "sample_inputs",
    "state_of",
    "with_health_check",
]
