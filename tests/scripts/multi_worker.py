"""One worker of a two-process `MultiWorkerMirroredStrategy` run on 127.0.0.1.

    python multi_worker.py INDEX PORT0,PORT1 INITIAL.npz OUT.npz

Loads the initial weights and data from INITIAL.npz, trains 3 epochs on
its shard of each global batch and writes its weights to OUT.npz.
"""

import json
import os
import sys

index, ports, initial, out = int(sys.argv[1]), sys.argv[2].split(","), *sys.argv[3:5]
# Read by TensorFlow when the strategy starts.
os.environ["TF_CONFIG"] = json.dumps(
    {
        "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
        "task": {"type": "worker", "index": index},
    }
)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from distributed_model import build  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = build()
data = np.load(initial)
for i, weight in enumerate(model.weights):
    weight.assign(data[f"w{i}"])
dataset = tf.data.Dataset.from_tensor_slices((data["x"], data["y"])).batch(16)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = (
    tf.data.experimental.AutoShardPolicy.DATA
)
model.fit(dataset.with_options(options), epochs=3, verbose=0)
np.savez(
    out,
    replicas=strategy.num_replicas_in_sync,
    **{f"w{i}": w.numpy() for i, w in enumerate(model.weights)},
)
