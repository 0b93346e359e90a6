"""Bad batches given to `fit` and `evaluate`: the errors, and the state they leave.

    python bad_batches.py

Run under JAX, whose step reports a bad batch through an error code read
every few calls.
"""

import json

import numpy as np
from harness import data
from harness import make_model
from harness import state


def error_of(call):
    """The `ValueError`'s message, or `None` when `call` succeeds."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


model = make_model()
x, y = data()
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
results = {}
x_nan = x.copy()
x_nan[40, 2, 2, 0] = np.nan  # in the second batch
cases = {
    "too_large": (x, y + 3),
    "negative": (x, y - 1),
    "fractional": (x, y + 0.5),
    "nan_input": (x_nan, y),
    "overflow": (x * 1e30, y),
}
for name, (xs, ys) in cases.items():
    message = error_of(
        lambda: model.fit(xs, ys, batch_size=32, epochs=1, verbose=0, shuffle=False)
    )
    # Batches before the bad one train; the state must stay finite.
    finite = all(np.isfinite(a).all() for a in state(model))
    results[name] = {"message": message, "finite": finite}
# A bad batch in the first step changes nothing at all.
before = state(model)
error_of(lambda: model.fit(x, y + 3, batch_size=32, epochs=1, verbose=0))
results["unchanged"] = all(np.array_equal(a, b) for a, b in zip(before, state(model)))
results["evaluate"] = error_of(lambda: model.evaluate(x, y + 0.5, verbose=0))
model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # still trains
results["trains_on"] = not all(
    np.array_equal(a, b) for a, b in zip(before, state(model))
)

# The error code is read every few calls: a bad 4th batch of 20 must still
# leave the model as 3 good steps leave it. A generator, so that the batches
# reach the step (arrays are checked before it).
x, y = data(n=640)
x_bad = x.copy()
x_bad[100, 0, 0, 0] = np.nan
clean = make_model()
clean.fit(x[:96], y[:96], batch_size=32, epochs=1, verbose=0, shuffle=False)
model = make_model()


def batches(xs, ys):
    for start in range(0, len(xs), 32):
        yield xs[start : start + 32], ys[start : start + 32]


results["late"] = error_of(lambda: model.fit(batches(x_bad, y), epochs=1, verbose=0))
results["late_state"] = max(
    float(np.abs(a - b).max()) for a, b in zip(state(clean), state(model))
)
results["late_evaluate"] = error_of(
    lambda: model.evaluate(batches(x_bad, y), verbose=0)
)
print(json.dumps(results))
