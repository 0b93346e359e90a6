"""The paper's loss and penalty gradients in PyTorch at the trained weights
that `trained_keras.py` saved; prints how far keras_duq's are from them.
Needs `torch`. See README.md in this folder.

Usage, from this folder, after `trained_keras.py` (float64 is the reference:
float32 rounding alone moves these gradients by about 1%):

    python trained_pytorch.py float64
"""

import glob
import sys

import numpy as np
import torch
import torch.nn.functional as F
from pytorch_steps import NUM_CLASSES
from pytorch_steps import DUQNet
from pytorch_steps import load_keras_weights

CONV = lambda a: a.transpose(2, 3, 1, 0)  # noqa: E731  (PyTorch OIHW -> Keras HWIO)
SAME = lambda a: a  # noqa: E731


def main():
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float64"
    torch.set_default_dtype(getattr(torch, dtype))
    torch.set_num_threads(1)
    data = np.load("trained_weights.npz")
    weights = {k.replace("|", "/"): data[k].astype(dtype) for k in data.files}
    net = DUQNet()
    load_keras_weights(net, weights)
    net.train()  # batch statistics, as in a training step
    x = torch.tensor(weights["x"].transpose(0, 3, 1, 2)).requires_grad_(True)
    labels = torch.tensor(data["y"]).long()
    y = F.one_hot(labels, NUM_CLASSES).to(torch.get_default_dtype())
    log_kernel = net.log_kernel(x)
    log_one_minus = torch.log(-torch.expm1(log_kernel.clamp(max=-1e-7)))
    bce = -(y * log_kernel + (1 - y) * log_one_minus).mean()
    input_gradient = torch.autograd.grad(log_kernel.exp().sum(), x, create_graph=True)[
        0
    ]
    penalty = ((input_gradient.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
    compared = {
        "backbone/conv2d/kernel": (net.conv[0].weight, CONV),
        "backbone/conv2d/bias": (net.conv[0].bias, SAME),
        "backbone/conv2d_1/kernel": (net.conv[1].weight, CONV),
        "backbone/conv2d_2/kernel": (net.conv[2].weight, CONV),
        "backbone/batch_normalization/gamma": (net.norm[0].weight, SAME),
        "backbone/batch_normalization_1/gamma": (net.norm[1].weight, SAME),
        "backbone/batch_normalization_2/gamma": (net.norm[2].weight, SAME),
        "backbone/dense/kernel": (net.dense.weight, lambda a: a.T),
        "duq_output/kernel": (net.W, lambda a: a.transpose(2, 0, 1).reshape(256, -1)),
    }
    reference = {"bce": bce.item(), "penalty": penalty.item()}
    for name, loss in (("bce", bce), ("penalty", penalty)):
        parameters = [p for p, _ in compared.values()]
        for path, (_, layout), gradient in zip(
            compared,
            compared.values(),
            torch.autograd.grad(loss, parameters, retain_graph=True),
        ):
            reference[f"{name}|{path}"] = layout(gradient.detach().numpy())
    print(
        f"PyTorch {dtype}: bce {reference['bce']:.8f}, penalty {reference['penalty']:.8f}"
    )
    for path in sorted(glob.glob(f"trained_keras_{dtype}*.npy")):
        keras_result = np.load(path, allow_pickle=True).item()
        print(
            f"\n{path}: bce {keras_result['bce']:.8f}, penalty {keras_result['penalty']:.8f}"
        )
        print(
            f"{'gradient of':12s} {'weight':38s} {'norm: PyTorch':>14s} "
            f"{'norm: keras':>12s} {'max abs diff / max abs':>23s}"
        )
        for key, value in reference.items():
            if "|" not in key:
                continue
            name, weight = key.split("|")
            difference = np.abs(keras_result[key] - value).max() / np.abs(value).max()
            print(
                f"{name:12s} {weight:38s} {np.linalg.norm(value):14.4e} "
                f"{np.linalg.norm(keras_result[key]):12.4e} {difference:23.1e}"
            )


if __name__ == "__main__":
    main()
