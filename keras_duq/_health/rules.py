"""The health checks' rules: each threshold, and why it is where it is.

The checks read them as `rules.NAME` (a test may patch one).
"""

from __future__ import annotations

import keras
import numpy as np

# Below float32's smallest normal number a kernel value has underflowed:
# `predict` returns it as a subnormal or as 0, and the certainty no longer
# ranks such examples.
UNDERFLOW_KERNEL_VALUE = float(np.finfo(np.float32).tiny)
UNDERFLOW_LOG_KERNEL = float(np.log(UNDERFLOW_KERNEL_VALUE))
# "(Nearly) every example": the fraction of examples at which a per-example
# failure warns.
MOST_EXAMPLES = 0.9
# A mean certainty on the training batches below this is no certainty at all:
# a trained model's is near 1 on the data it was fit to.
NEGLIGIBLE_CERTAINTY = 1e-3
# A mean certainty of in-distribution inputs (inference mode) below this is
# far below any threshold one would pick by hand (0.5, say): such a threshold
# would refuse nearly every input, though the certainty may still rank
# inputs well. Thresholds then come from validation data.
LOW_CERTAINTY = 0.1
# An input-gradient norm below this counts as zero (two-sided penalty only:
# it is then within 2e-3 of 1, its value at a zero gradient).
ZERO_GRADIENT_NORM = 1e-3
# Relative RMS distance between the inference-mode features and those that
# statistics re-estimated on the sample (`SAMPLE_SIZE` examples) would give,
# above which the statistics warn. Moving statistics that follow the weights
# still scatter by a fraction of a standard deviation per layer, and these
# errors add up over layers: the threshold sits above that scatter.
BATCH_NORM_GAP = 0.15
# The per-epoch comparison of the modes takes at most this share of the
# training time (it only logs `batch_norm_gap`; the warnings come from the
# checks at the end of `fit`). Its three passes over the sample are a fixed
# cost per epoch, large beside the short epochs of a small data set on an
# accelerator: there it runs every few epochs, and the log is NaN between.
CHECK_TIME_SHARE = 0.05
# Kernel value of one class at another class's centroid above which the two
# centroids overlap.
CENTROID_OVERLAP = 0.5
# A class whose centroid count gained less than this fraction of what the
# most frequent class's gained during `fit` received (almost) no examples.
UNSEEN_CLASS_SHARE = 1e-3
# A fresh DUQ model's kernel values underflow until its embeddings reach the
# centroids, and the centroids start random: `fit` checks nothing before this
# many steps, and before the centroids' moving averages owe at least this
# share to data.
WARMUP_STEPS = 100
WARMUP_DATA_SHARE = 0.5
# Examples drawn from the inputs for the once-per-epoch checks (at least
# one batch), and the chunk size of their passes when the batch size is not
# known (Keras's default batch size).
SAMPLE_SIZE = 512
DEFAULT_CHUNK_SIZE = 32
# ... and fewer for large inputs: the sample is kept with the model and
# passed three times per check (e.g. 111 images of 224x224x3 float32).
SAMPLE_BYTES = 64 * 2**20
LISTED_LAYERS = 5
# Layers that put their inputs on a known scale: a backbone with one of them
# does not depend on its inputs being standardised.
NORMALIZING_LAYERS = (
    keras.layers.Normalization,
    keras.layers.Rescaling,
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
)
# Layers that add random noise in training mode, and layers that only
# reshape: a backbone whose features come out of a noise layer, through
# reshaping layers at most, hands DUQ's kernel noisy features in training.
NOISE_LAYERS = (
    keras.layers.Dropout,
    keras.layers.GaussianDropout,
    keras.layers.GaussianNoise,
    keras.layers.AlphaDropout,
)
RESHAPING_LAYERS = (keras.layers.Flatten, keras.layers.Reshape, keras.layers.Permute)
# Standardised inputs have mean 0 and standard deviation 1: flagged are a
# mean beyond one standard deviation, or a scale off by more than 2x (images
# scaled to [0, 1] have a standard deviation of 0.25-0.4; two moons' raw
# coordinates, on which the paper's demo works, about 0.75).
INPUT_MEAN_TOLERANCE = 1.0
INPUT_SCALE_RANGE = (0.5, 2.0)
# Layers that average over the positions of a sequence. After an `Embedding`
# without `mask_zero`, they average the padding in: the features then encode
# each input's length (how much of it is padding).
AVERAGING_LAYERS = (keras.layers.GlobalAveragePooling1D, keras.layers.AveragePooling1D)
# The token id Keras pads with (`TextVectorization`, `pad_sequences`, and the
# id `Embedding(mask_zero=True)` masks).
PADDING_ID = 0
