"""A floor for the penalty step in TensorFlow: the paper's CNN step in bare TF ops.

The same computation as keras_duq's FashionMNIST penalty step (three
convolutions with batch statistics, max pooling, the 256-unit layer, the
DUQ head, BCE plus the two-sided penalty by double backprop, an SGD update),
written directly in TensorFlow ops in one `tf.function`: no Keras layers, no
batch checks, no finiteness guard, no centroid update. Batch
normalization's statistics are computed three ways:

- `exact`: mean and variance as keras_duq computes them in the penalty step
  (`keras_duq/_moments.py`);
- `stopgrad`: `tf.nn.moments`'s formula (variance around a stopped mean);
- `fused`: `tf.compat.v1.nn.fused_batch_norm` (oneDNN's fused kernel).

    python benchmarks/bare_penalty_step.py exact   # prints the median step time
"""

import sys
import time

import numpy as np
import tensorflow as tf

mode = sys.argv[1] if len(sys.argv) > 1 else "exact"
rng = np.random.default_rng(0)
def var(shape, scale=0.05): return tf.Variable(rng.normal(size=shape).astype("float32")*scale)
convs = [(var((3,3,1,64)), var((64,),0)), (var((3,3,64,128)), var((128,),0)), (var((3,3,128,128)), var((128,),0))]
bns = [(tf.Variable(tf.ones(c)), tf.Variable(tf.zeros(c))) for c in (64,128,128)]
dense = (var((512,256)), var((256,),0)); W = var((256, 2560))
centroids = tf.constant(rng.normal(size=(256,10)).astype("float32"))
weights = [v for pair in convs+bns+[dense] for v in pair] + [W]
def bn(x, gamma, beta):
    if mode == "fused":
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(x, gamma, beta, epsilon=1e-5, is_training=True)
        return y
    mean = tf.reduce_mean(x, [0,1,2], keepdims=True)
    if mode == "stopgrad":
        variance = tf.reduce_mean(tf.math.squared_difference(x, tf.stop_gradient(mean)), [0,1,2], keepdims=True)
    else:
        variance = tf.reduce_mean(tf.math.squared_difference(x, mean), [0,1,2], keepdims=True)
    return tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-5)
def forward(x):
    for (k,b),(g,be),pad in zip(convs,bns,("SAME","SAME","VALID")):
        x = tf.nn.conv2d(x,k,1,pad)+b
        x = tf.nn.max_pool2d(tf.nn.relu(bn(x,g,be)),2,2,"VALID")
    x = tf.nn.relu(tf.reshape(x,(-1,512))@dense[0]+dense[1])
    z = tf.reshape(x@W, (-1,256,10))
    return tf.exp(-tf.reduce_mean((z-centroids)**2,1)/(2*0.01))
@tf.function
def step(x, y):
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            inner.watch(x); k = forward(x); s = tf.reduce_sum(k)
        g = inner.gradient(s, x)
        norm = tf.sqrt(tf.reduce_sum(tf.reshape(g,(128,-1))**2,1)+1e-12)
        loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(y, k)) + 0.05*tf.reduce_mean((norm-1)**2)
    grads = outer.gradient(loss, weights)
    for w, gr in zip(weights, grads): w.assign_sub(0.001*gr)
    return loss
x = tf.constant(rng.normal(size=(128,28,28,1)).astype("float32")); y = tf.one_hot(rng.integers(0,10,128),10)
for _ in range(3): step(x,y)
ts=[]
for _ in range(15):
    t=time.perf_counter(); step(x,y).numpy(); ts.append(time.perf_counter()-t)
print(mode, "median ms", round(1000*np.median(ts),1))
