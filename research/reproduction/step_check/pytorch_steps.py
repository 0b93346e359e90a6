"""The paper's training step written in PyTorch (from Appendix A and the
paper's description of its code), replayed from keras_duq's initial weights
on the same batches. Needs `torch` (not a keras_duq dependency); run after
`keras_steps.py`, in the same folder. See README.md in this folder.

Two variants of the cross-entropy: "pytorch" is
`torch.nn.functional.binary_cross_entropy` on the kernel values, as the
paper's code; "exact" is the same loss in log space with the exact gradient;
"exact64" is "exact" in float64, to show how far float32 rounding alone
moves the weights.
"""

import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

SNAPSHOT_STEPS = (1, 2, 5, 10, 20, 40)
NUM_CLASSES, LENGTH_SCALE, GAMMA, PENALTY = 10, 0.1, 0.999, 0.05


class DUQNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.ModuleList(
            [
                nn.Conv2d(1, 64, 3, padding=1),
                nn.Conv2d(64, 128, 3, padding=1),
                nn.Conv2d(128, 128, 3),
            ]
        )
        self.norm = nn.ModuleList([nn.BatchNorm2d(c) for c in (64, 128, 128)])
        self.dense = nn.Linear(512, 256)
        # W as (centroid dims, classes, features); counts N and sums m.
        self.W = nn.Parameter(torch.zeros(256, NUM_CLASSES, 256))
        self.register_buffer("N", torch.zeros(NUM_CLASSES))
        self.register_buffer("m", torch.zeros(256, NUM_CLASSES))

    def features(self, x):
        for conv, norm in zip(self.conv, self.norm):
            x = F.max_pool2d(F.relu(norm(conv(x))), 2)
        # keras flattens channels-last maps
        return F.relu(self.dense(x.permute(0, 2, 3, 1).flatten(1)))

    def embed(self, x):
        return torch.einsum("bf,dcf->bdc", self.features(x), self.W)

    def log_kernel(self, x):
        centroids = self.m / self.N[None]
        distances = ((self.embed(x) - centroids[None]) ** 2).mean(1)
        return -distances / (2 * LENGTH_SCALE**2)


def load_keras_weights(net, weights):
    def tensor(array):
        return torch.tensor(np.ascontiguousarray(array))

    convs = ["conv2d", "conv2d_1", "conv2d_2"]
    norms = ["batch_normalization", "batch_normalization_1", "batch_normalization_2"]
    with torch.no_grad():
        for conv, norm, c, b in zip(net.conv, net.norm, convs, norms):
            conv.weight.copy_(
                tensor(weights[f"backbone/{c}/kernel"].transpose(3, 2, 0, 1))
            )
            conv.bias.copy_(tensor(weights[f"backbone/{c}/bias"]))
            norm.weight.copy_(tensor(weights[f"backbone/{b}/gamma"]))
            norm.bias.copy_(tensor(weights[f"backbone/{b}/beta"]))
            norm.running_mean.copy_(tensor(weights[f"backbone/{b}/moving_mean"]))
            norm.running_var.copy_(tensor(weights[f"backbone/{b}/moving_variance"]))
        net.dense.weight.copy_(tensor(weights["backbone/dense/kernel"].T))
        net.dense.bias.copy_(tensor(weights["backbone/dense/bias"]))
        kernel = weights["duq_output/kernel"].reshape(256, 256, NUM_CLASSES)
        net.W.copy_(tensor(kernel.transpose(1, 2, 0)))
        net.N.copy_(tensor(weights["duq_output/centroid_counts"]))
        net.m.copy_(tensor(weights["duq_output/centroid_sums"]))


def keras_layout(net):
    """The weights compared with keras_duq's, in Keras's layout and names."""
    return {
        "backbone/conv2d/kernel": net.conv[0]
        .weight.detach()
        .numpy()
        .transpose(2, 3, 1, 0),
        "backbone/conv2d_2/kernel": net.conv[2]
        .weight.detach()
        .numpy()
        .transpose(2, 3, 1, 0),
        "backbone/batch_normalization_2/gamma": net.norm[2].weight.detach().numpy(),
        "backbone/dense/kernel": net.dense.weight.detach().numpy().T,
        "duq_output/kernel": net.W.detach().numpy().transpose(2, 0, 1).reshape(256, -1),
        "duq_output/centroid_sums": net.m.numpy(),
    }


def run(variant, weights, x_all, y_all, batch_size=128):
    dtype = np.float64 if variant == "exact64" else np.float32
    torch.set_default_dtype(torch.float64 if variant == "exact64" else torch.float32)
    weights = {k: v.astype(dtype) for k, v in weights.items()}
    x_all = x_all.astype(dtype)
    torch.manual_seed(0)
    net = DUQNet()
    load_keras_weights(net, weights)
    optimizer = torch.optim.SGD(
        net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4
    )
    records, snapshots = [], {}
    for step in range(len(x_all) // batch_size):
        batch = slice(step * batch_size, (step + 1) * batch_size)
        x = torch.tensor(x_all[batch].transpose(0, 3, 1, 2)).requires_grad_(True)
        labels = torch.tensor(y_all[batch]).long()
        y = F.one_hot(labels, NUM_CLASSES).to(torch.get_default_dtype())
        net.train()
        optimizer.zero_grad()
        log_kernel = net.log_kernel(x)
        kernel = log_kernel.exp()
        if variant == "pytorch":
            bce = F.binary_cross_entropy(kernel, y)
        else:
            log_one_minus = torch.log(-torch.expm1(log_kernel.clamp(max=-1e-7)))
            bce = -(y * log_kernel + (1 - y) * log_one_minus).mean()
        gradient = torch.autograd.grad(kernel.sum(), x, create_graph=True)[0]
        penalty = ((gradient.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
        (bce + PENALTY * penalty).backward()
        optimizer.step()
        with torch.no_grad():
            net.eval()
            embedded = net.embed(x)
            net.N.mul_(GAMMA).add_((1 - GAMMA) * y.sum(0))
            net.m.mul_(GAMMA).add_(
                (1 - GAMMA) * torch.einsum("bdc,bc->dc", embedded, y)
            )
        true_log_kernel = log_kernel.gather(1, labels[:, None])
        records.append(
            {
                "bce": bce.item(),
                "gradient_penalty": penalty.item(),
                "accuracy": (log_kernel.argmax(1) == labels).float().mean().item(),
                "true_kernel_below_1e-12": (true_log_kernel < np.log(1e-12))
                .float()
                .mean()
                .item(),
            }
        )
        if step + 1 in SNAPSHOT_STEPS:
            snapshots[step + 1] = {k: v.copy() for k, v in keras_layout(net).items()}
    np.save(f"pytorch_{variant}.npy", {"records": records, "snapshots": snapshots})


def main():
    torch.set_num_threads(2)
    weights = {
        k.replace("|", "/"): v for k, v in np.load("initial_weights.npz").items()
    }
    batches = np.load("batches.npz")
    for variant in sys.argv[1:] or ("exact", "pytorch", "exact64"):
        run(variant, weights, batches["x"], batches["y"])


if __name__ == "__main__":
    main()
