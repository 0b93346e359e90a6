"""`fit` with `keras.callbacks.BackupAndRestore`, killed mid-epoch or not.

    python interrupted_fit.py kill BACKUP_DIR OUT_DIR    # SIGKILLs itself in epoch 2
    python interrupted_fit.py resume BACKUP_DIR OUT_DIR  # resumes; then trains anew

Run under the backend in `KERAS_BACKEND`, with `tests/` importable
(`harness.script_env`). `resume` writes every variable of
the resumed model (the centroid state included) and `optimizer.iterations`
to `OUT_DIR/resumed.npz`, and the same of a model trained uninterrupted in
the same process to `OUT_DIR/full.npz`.
"""

import os
import signal
import sys

import keras
import numpy as np
from harness import data
from harness import make_model

EPOCHS, KILL_EPOCH, KILL_BATCH = 3, 1, 3


class KillMidEpoch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == KILL_EPOCH and batch == KILL_BATCH:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def train(callbacks):
    model = make_model(health_checks=False)
    x, y = data(n=192)
    model.fit(
        x,
        y,
        batch_size=32,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )
    return model


def save(model, path):
    arrays = {
        f"v{i}": keras.ops.convert_to_numpy(v) for i, v in enumerate(model.weights)
    }
    arrays["iterations"] = keras.ops.convert_to_numpy(model.optimizer.iterations)
    np.savez(path, **arrays)


def main(mode, backup_dir, output_dir):
    backup = keras.callbacks.BackupAndRestore(backup_dir)
    if mode == "kill":
        train([backup, KillMidEpoch()])
        raise SystemExit("not killed")
    save(train([backup]), os.path.join(output_dir, "resumed.npz"))
    save(train([]), os.path.join(output_dir, "full.npz"))


if __name__ == "__main__":
    main(*sys.argv[1:])
