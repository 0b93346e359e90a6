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

from keras_duq._duq_model import DUQModel
from keras_duq._duq_output import DUQOutput
from keras_duq._wrap import wrap

__version__ = "0.1.0"

__all__ = ["DUQModel", "DUQOutput", "wrap", "__version__"]
