"""Prints keras_duq's steps beside the PyTorch ones (numpy only)."""

import numpy as np

PAIRS = [
    ("keras_eps0", "pytorch_exact", "bce_epsilon=0 vs PyTorch, exact log-space BCE"),
    (
        "keras_eps1e-12",
        "pytorch_pytorch",
        "bce_epsilon=1e-12 vs PyTorch, F.binary_cross_entropy",
    ),
    (
        "keras_eps0",
        "pytorch_pytorch",
        "bce_epsilon=0 vs PyTorch, F.binary_cross_entropy",
    ),
    (
        "pytorch_exact64",
        "pytorch_exact",
        "float32 rounding: PyTorch exact in float64 vs float32",
    ),
]


def main():
    for keras_name, torch_name, title in PAIRS:
        k = np.load(f"{keras_name}.npy", allow_pickle=True).item()
        t = np.load(f"{torch_name}.npy", allow_pickle=True).item()
        print(f"== {title}")
        print("first and second run of the title; share: of the second run's batch")
        print(
            "step  bce first bce second  pen first pen second  acc first acc second  "
            "share of K_true < 1e-12"
        )
        for step in (1, 2, 3, 5, 10, 20, 30, 40):
            if step > len(t["records"]):
                break
            a, b = k["records"][step - 1], t["records"][step - 1]
            print(
                f"{step:4d} {a['bce']:10.5f} {b['bce']:10.5f} {a['gradient_penalty']:11.5f} "
                f"{b['gradient_penalty']:10.5f} {a['accuracy']:10.3f} {b['accuracy']:10.3f} "
                f"{b['true_kernel_below_1e-12']:10.2f}"
            )
        print("max |first - second| / max |first| of the weights after step:")
        for step, weights in sorted(t["snapshots"].items()):
            errors = []
            for name, value in weights.items():
                reference = k["snapshots"][step][name].astype("float64")
                error = np.abs(reference - value).max() / np.abs(reference).max()
                errors.append(f"{'/'.join(name.split('/')[-2:])} {error:.1e}")
            print(f"  {step:3d}: " + ", ".join(errors))
        print()


if __name__ == "__main__":
    main()
