"""keras_duq: Deterministic Uncertainty Quantification (DUQ) for Keras 3.

DUQ (van Amersfoort et al., ICML 2020) replaces a classifier's softmax with
per-class RBF kernels around class centroids. One deterministic forward pass
gives a prediction (argmax of the kernel values) and a certainty (their max):
far from every centroid means out of distribution.

Public API:

- `wrap(backbone, num_classes, ...)`: turn any Keras backbone into a
  `DUQModel`.
- `DUQOutput`: the output layer (per-class projections, RBF kernels and the
  centroid moving-average state).
- `DUQModel`: the model class with the DUQ training step (loss, gradient
  penalty by double backprop, coupled weight decay, centroid update).
- `plot_certainty_map(model, x_train, y_train)`: certainty over a 2-D grid.

Evaluation (numpy / scikit-learn; works for softmax models and ensembles too):

- `certainty_scores(scores, method)`: per-example certainty (`"max"` or
  `"negative_entropy"`).
- `ood_metrics(in_certainty, ood_certainty)`: AUROC, AUPR and FPR at 95% TPR,
  with OoD as the positive class.
- `misclassification_auroc(certainty, correct)`: certainty of correct vs.
  wrong predictions, for choosing the gradient penalty without OoD data.
- `rejection_curve(in_certainty, in_correct, ood_certainty)`: accuracy as
  the least certain data is rejected, with its oracle.
- `OODEvaluation`: a callback logging the OoD metrics during `fit`.
- `plot_roc_curve`, `plot_rejection_curve`, `plot_certainty_histograms`:
  the paper's figures, each returned as a `matplotlib.figure.Figure`.

Data (the paper's FashionMNIST vs. MNIST benchmark): `load_fashion_mnist`,
`load_mnist_test`, `read_idx`, `normalize` (with `FASHION_MNIST_MEAN` and
`FASHION_MNIST_STD`), `make_dataset`.

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

from keras_duq._datasets import FASHION_MNIST_MEAN
from keras_duq._datasets import FASHION_MNIST_STD
from keras_duq._datasets import load_fashion_mnist
from keras_duq._datasets import load_mnist_test
from keras_duq._datasets import make_dataset
from keras_duq._datasets import normalize
from keras_duq._datasets import read_idx
from keras_duq._duq_model import DUQModel
from keras_duq._duq_output import DUQOutput
from keras_duq._evaluation import OODEvaluation
from keras_duq._evaluation import certainty_scores
from keras_duq._evaluation import misclassification_auroc
from keras_duq._evaluation import ood_metrics
from keras_duq._evaluation import rejection_curve
from keras_duq._plots import plot_certainty_histograms
from keras_duq._plots import plot_certainty_map
from keras_duq._plots import plot_rejection_curve
from keras_duq._plots import plot_roc_curve
from keras_duq._wrap import wrap

__version__ = "0.1.0"

__all__ = [
    "DUQModel",
    "DUQOutput",
    "plot_certainty_map",
    "wrap",
    "__version__",
    # Evaluation.
    "OODEvaluation",
    "certainty_scores",
    "misclassification_auroc",
    "ood_metrics",
    "rejection_curve",
    "plot_certainty_histograms",
    "plot_rejection_curve",
    "plot_roc_curve",
    # Data.
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "load_fashion_mnist",
    "load_mnist_test",
    "make_dataset",
    "normalize",
    "read_idx",
]
