"""keras_duq: Deterministic Uncertainty Quantification (DUQ) for Keras 3.

DUQ (van Amersfoort et al., ICML 2020) replaces a classifier's softmax with
per-class RBF kernels around class centroids. One deterministic forward pass
gives a prediction (argmax of the kernel values) and a certainty (their max):
far from every centroid means out of distribution.

The core:

- `wrap(backbone, num_classes, ...)`: turn any Keras backbone into a
  `DUQModel`.
- `DUQOutput`: the output layer (per-class projections, RBF kernels and the
  centroid moving-average state).
- `DUQModel`: the model with the DUQ training step (loss, gradient penalty by
  double backprop, coupled weight decay, centroid update).
- `DUQBatchError`: what a rejected batch or training step raises.
- `load_model(path)`: `keras.models.load_model` with clear errors for a
  missing, truncated or damaged `.keras` file.
- `DUQHealthWarning` and its subclasses: what `fit`, `evaluate` and
  `predict` warn about when DUQ fails quietly; and
  `recompute_batch_norm_statistics(model, x)`, the fix for unsettled
  BatchNormalization statistics.

Around it, each in its own namespace (imported on first use):

- `keras_duq.evaluation`: certainty scores, OoD metrics (AUROC, AUPR,
  FPR at 95% TPR), misclassification AUROC, rejection curves.
- `keras_duq.callbacks`: `OODEvaluation`, OoD metrics logged during `fit`;
  `HealthCheck`, the health checks; `RecomputeBatchNormStatistics`,
  BatchNormalization statistics re-estimated after each epoch.
- `keras_duq.plots`: the paper's figures (needs matplotlib).
- `keras_duq.datasets`: the paper's FashionMNIST vs MNIST data, offline.

Example:

```python
import keras
import keras_duq

backbone = keras.Sequential([
    keras.Input((2,)),
    keras.layers.Dense(20, activation="relu"),
    keras.layers.Dense(20, activation="relu"),
])
model = keras_duq.wrap(backbone, num_classes=2, length_scale=0.3,
                       gradient_penalty=1.0)
model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9))
model.fit(x_train, y_train, epochs=30, batch_size=64)
certainty = model.predict(x_test).max(axis=1)
```
"""

import importlib

from keras_duq._batch_norm import recompute_batch_norm_statistics
from keras_duq._duq_model import DUQModel
from keras_duq._duq_output import DUQOutput
from keras_duq._health import BatchNormStatisticsWarning
from keras_duq._health import CentroidWarning
from keras_duq._health import ConstantPenaltyWarning
from keras_duq._health import DUQHealthWarning
from keras_duq._health import FeatureDropoutWarning
from keras_duq._health import InputScaleWarning
from keras_duq._health import KernelUnderflowWarning
from keras_duq._health import LowCertaintyWarning
from keras_duq._health import PaddingWarning
from keras_duq._saved_configs import load_model
from keras_duq._spectral_normalization import SpectralNormalization
from keras_duq._spectral_normalization import spectral_normalize
from keras_duq._validation import DUQBatchError
from keras_duq._wrap import PAPER_SETTINGS
from keras_duq._wrap import wrap

__version__ = "0.2.0"

__all__ = [
    "BatchNormStatisticsWarning",
    "CentroidWarning",
    "DUQBatchError",
    "ConstantPenaltyWarning",
    "DUQHealthWarning",
    "DUQModel",
    "DUQOutput",
    "FeatureDropoutWarning",
    "InputScaleWarning",
    "KernelUnderflowWarning",
    "LowCertaintyWarning",
    "PaddingWarning",
    "PAPER_SETTINGS",
    "SpectralNormalization",
    "load_model",
    "recompute_batch_norm_statistics",
    "spectral_normalize",
    "wrap",
    "__version__",
]

_SUBMODULES = ("callbacks", "datasets", "evaluation", "plots", "tuning")


def __getattr__(name):
    # Submodules load on first use, so `import keras_duq` pulls in neither
    # scikit-learn nor matplotlib.
    if name in _SUBMODULES:
        return importlib.import_module(f"keras_duq.{name}")
    raise AttributeError(
        f"module 'keras_duq' has no attribute {name!r}. Besides {__all__[:-1]}, "
        f"it holds the submodules {list(_SUBMODULES)}: e.g. "
        "`keras_duq.evaluation.ood_metrics`, `keras_duq.callbacks.OODEvaluation`."
    )


def __dir__():
    return sorted(__all__ + list(_SUBMODULES))
