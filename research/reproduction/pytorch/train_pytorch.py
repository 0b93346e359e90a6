"""The paper's FashionMNIST DUQ run, in PyTorch on a CPU or GPU, for comparison.

A diagnostic, not part of keras_duq: it asks whether the AUROC gap between
keras_duq and the paper comes from TensorFlow and Keras, from the GPU's
numerics (cuDNN convolutions run in TF32 by default on NVIDIA GPUs;
`--tf32 off` runs them in float32), or from chance. Results so far: this
folder's README. It trains the model of the
paper's Appendix A with the paper code's step: PyTorch's
`binary_cross_entropy` on the kernel values, the two-sided penalty
(lambda 0.05) by double backprop, SGD (lr 0.05, momentum 0.9, weight decay
1e-4, lr / 5 after epochs 10 and 20), centroids updated in eval mode after
the step (gamma 0.999), batch 128 with the last partial batch dropped.

Resumable: the state is saved after every epoch in `--state-dir`, and a rerun
continues from it. Every 5 epochs it logs the test accuracy and the AUROC of
FashionMNIST test vs MNIST test (score: max kernel value; MNIST positive),
both normalised with FashionMNIST's mean and std, BatchNorm in eval mode.

Needs `torch` and `numpy` only (not keras_duq's dependencies):

    python train_pytorch.py --seed 0 --threads 1 --state-dir state_seed0
    python train_pytorch.py --seed 0 --device cuda --tf32 off --state-dir gpu_fp32_seed0

`DUQ_DATA` overrides the data folder (default `../shared/data` of the
repository), which holds `keras/datasets/fashion-mnist/*-idx*-ubyte.gz` and
`mnist/t10k-*-idx*-ubyte.gz`.
"""

import argparse
import gzip
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

DATA = os.environ.get("DUQ_DATA") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "shared", "data"
)
MEAN, STD = 0.2861, 0.3530
NUM_CLASSES, LENGTH_SCALE, GAMMA, PENALTY = 10, 0.1, 0.999, 0.05


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(name, split):
    folder = {"fashion": "keras/datasets/fashion-mnist", "mnist": "mnist"}[name]
    prefix = os.path.join(DATA, folder, f"{split}-")
    images = read_idx(prefix + "images-idx3-ubyte.gz").astype(np.float32) / 255.0
    labels = read_idx(prefix + "labels-idx1-ubyte.gz").astype(np.int64)
    return torch.tensor((images - MEAN) / STD)[:, None], torch.tensor(labels)


def load_all(device, train_subset=None):
    """FashionMNIST train and test images and labels, and MNIST test images."""
    x_train, y_train = (t[:train_subset].to(device) for t in load("fashion", "train"))
    x_test, y_test = (t.to(device) for t in load("fashion", "t10k"))
    return x_train, y_train, x_test, y_test, load("mnist", "t10k")[0].to(device)


def state_paths(state_dir):
    """Creates `state_dir`; returns its checkpoint and epoch-log paths."""
    os.makedirs(state_dir, exist_ok=True)
    return os.path.join(state_dir, "state.pt"), os.path.join(state_dir, "epochs.jsonl")


def make_optimizer(parameters):
    """The paper's SGD (lr 0.05, momentum 0.9, weight decay 1e-4) and its
    schedule (lr / 5 after epochs 10 and 20)."""
    optimizer = torch.optim.SGD(parameters, lr=0.05, momentum=0.9, weight_decay=1e-4)
    return optimizer, torch.optim.lr_scheduler.MultiStepLR(
        optimizer, [10, 20], gamma=0.2
    )


def resume(state_path, device, net, optimizer, scheduler):
    """Loads the state `save_epoch` saved into `net`, `optimizer` and `scheduler`.

    Returns the number of epochs done and the whole state, whose random
    generators the caller restores; `0, None` when there is none.
    """
    if not os.path.exists(state_path):
        return 0, None
    state = torch.load(state_path, map_location=device)
    net.load_state_dict(state["net"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    print(f"resumed after epoch {state['epoch']}")
    return state["epoch"], state


def steps_per_epoch(examples, batch_size, last_batch, max_steps):
    """Full batches, plus the partial last one with `last_batch="keep"`;
    at most `max_steps` when given."""
    steps = examples // batch_size
    if last_batch == "keep":
        steps = -(-examples // batch_size)
    if max_steps:
        steps = min(steps, max_steps)
    return steps


def save_epoch(
    state_path, log_path, records, epoch, net, optimizer, scheduler, **generators
):
    """Saves the training state after `epoch` (replacing the last one whole,
    never half written), then appends the epoch's records to the log.

    `generators`: the states of the data order's random generators, by name.
    """
    state = {
        "net": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        **generators,
        "epoch": epoch,
    }
    torch.save(state, state_path + ".tmp")
    os.replace(state_path + ".tmp", state_path)
    with open(log_path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


class DUQNet(nn.Module):
    def __init__(self, bias_init="pytorch"):
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
        self.W = nn.Parameter(torch.normal(torch.zeros(256, NUM_CLASSES, 256), 0.05))
        self.register_buffer("N", torch.full((NUM_CLASSES,), 12.0))
        self.register_buffer(
            "m", torch.normal(torch.zeros(256, NUM_CLASSES), 1.0) * 12.0
        )
        if bias_init == "zeros":
            # As Keras's Conv2D and Dense start (PyTorch draws them uniformly).
            for layer in [*self.conv, self.dense]:
                nn.init.zeros_(layer.bias)

    def embed(self, x):
        for conv, norm in zip(self.conv, self.norm):
            x = F.max_pool2d(F.relu(norm(conv(x))), 2)
        features = F.relu(self.dense(x.flatten(1)))
        return torch.einsum("bf,dcf->bdc", features, self.W)

    def log_kernel(self, x):
        centroids = self.m / self.N[None]
        distances = ((self.embed(x) - centroids[None]) ** 2).mean(1)
        return -distances / (2 * LENGTH_SCALE**2)

    def forward(self, x):
        return torch.exp(self.log_kernel(x))


def exact_binary_cross_entropy(log_kernel, y):
    """Per-element BCE from `log K`, with the exact gradient (keras_duq's default).

    PyTorch's `binary_cross_entropy` (the paper code's loss) divides its
    gradient by `max(K (1 - K), 1e-12)`; at the random start every K is far
    below 1e-12, so that loss hardly trains until the centroids have moved.
    As `keras_duq._ops.binary_cross_entropy` with `epsilon=0`: `log(1 - K)` is
    `log(-expm1(log K))`, with `log K` capped just below 0.
    """
    log_one_minus = torch.log(-torch.expm1(log_kernel.clamp_max(-1e-7)))
    return -(y * log_kernel + (1 - y) * log_one_minus)


def train_step(net, optimizer, x, labels, exact_bce=False):
    """The paper code's step: BCE plus the two-sided penalty, then the centroids.

    `exact_bce=True` swaps PyTorch's `binary_cross_entropy` for
    `exact_binary_cross_entropy`. Returns the kernel values, BCE and penalty.
    """
    x = x.clone().requires_grad_(True)
    y = F.one_hot(labels, NUM_CLASSES).to(x.dtype)
    net.train()
    optimizer.zero_grad()
    log_kernel = net.log_kernel(x)
    kernel = torch.exp(log_kernel)
    if exact_bce:
        bce = exact_binary_cross_entropy(log_kernel, y).mean()
    else:
        bce = F.binary_cross_entropy(kernel, y)
    gradient = torch.autograd.grad(kernel.sum(), x, create_graph=True)[0]
    penalty = ((gradient.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
    (bce + PENALTY * penalty).backward()
    optimizer.step()
    with torch.no_grad():
        net.eval()
        embedded = net.embed(x.detach())
        net.N.mul_(GAMMA).add_((1 - GAMMA) * y.sum(0))
        net.m.mul_(GAMMA).add_((1 - GAMMA) * torch.einsum("bdc,bc->dc", embedded, y))
    return kernel.detach(), bce.detach(), penalty.detach()


def auroc(in_scores, ood_scores):
    """AUROC with OoD as the positive class and `-certainty` as its score."""
    scores = -np.concatenate([in_scores, ood_scores])
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    average = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(average, counts)
    n_pos, n_neg = len(ood_scores), len(in_scores)
    return float((ranks[n_neg:].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@torch.no_grad()
def evaluate(net, x_test, y_test, x_ood):
    net.eval()
    kernel_test = torch.cat([net(x) for x in x_test.split(1000)])
    kernel_ood = torch.cat([net(x) for x in x_ood.split(1000)])
    certainty_test, predictions = kernel_test.max(1)
    return {
        "test_accuracy": (predictions == y_test).float().mean().item(),
        "auroc": auroc(
            certainty_test.cpu().numpy(), kernel_ood.max(1)[0].cpu().numpy()
        ),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=None, help="timing only")
    parser.add_argument(
        "--train-subset",
        type=int,
        default=None,
        help="train on the first N images only (smoke tests of this script)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--tf32",
        choices=("on", "off"),
        default="on",
        help="on a GPU: cuDNN convolutions in TF32 (PyTorch's default) or float32",
    )
    parser.add_argument(
        "--bias-init",
        choices=("pytorch", "zeros"),
        default="pytorch",
        help="conv and dense biases: PyTorch's uniform default or zeros (Keras's)",
    )
    parser.add_argument(
        "--last-batch",
        choices=("drop", "keep"),
        default="drop",
        help="the epoch's last partial batch: dropped (the paper's code) or kept "
        "(keras_duq.datasets.make_dataset)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.backends.cudnn.allow_tf32 = args.tf32 == "on"
    device = torch.device(args.device)
    state_path, log_path = state_paths(args.state_dir)
    x_train, y_train, x_test, y_test, x_ood = load_all(device, args.train_subset)

    torch.manual_seed(args.seed)
    net = DUQNet(args.bias_init).to(device)
    optimizer, scheduler = make_optimizer(net.parameters())
    generator = torch.Generator().manual_seed(args.seed)
    start_epoch, state = resume(state_path, device, net, optimizer, scheduler)
    if state is not None:
        generator.set_state(state["generator"].cpu())

    batch_size = 128
    for epoch in range(start_epoch + 1, args.epochs + 1):
        started = time.perf_counter()
        order = torch.randperm(len(x_train), generator=generator).to(device)
        # Summed on the device: reading them every step would make the GPU wait.
        totals = {
            k: torch.zeros((), device=device)
            for k in ("bce", "gradient_penalty", "accuracy")
        }
        steps = steps_per_epoch(len(order), batch_size, args.last_batch, args.max_steps)
        for step in range(steps):
            index = order[step * batch_size : (step + 1) * batch_size]
            labels = y_train[index]
            kernel, bce, penalty = train_step(net, optimizer, x_train[index], labels)
            totals["bce"] += bce
            totals["gradient_penalty"] += penalty
            totals["accuracy"] += (kernel.argmax(1) == labels).float().mean()
        if args.max_steps:
            seconds = time.perf_counter() - started
            print(f"{steps} steps: {seconds / steps:.3f} s/step")
            return
        scheduler.step()
        record = {
            "epoch": epoch,
            **{k: v.item() / steps for k, v in totals.items()},
            "device": args.device,
            "tf32": args.tf32,
            "seed": args.seed,
            "bias_init": args.bias_init,
            "last_batch": args.last_batch,
        }
        if epoch % 5 == 0 or epoch == args.epochs:
            record.update(evaluate(net, x_test, y_test, x_ood))
        record["seconds"] = time.perf_counter() - started
        print(json.dumps(record), flush=True)
        save_epoch(
            state_path,
            log_path,
            [record],
            epoch,
            net,
            optimizer,
            scheduler,
            generator=generator.get_state(),
        )


if __name__ == "__main__":
    main()
