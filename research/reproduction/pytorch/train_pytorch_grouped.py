"""Many independent runs of `train_pytorch.py`'s recipe at once, on one GPU.

A diagnostic, not part of keras_duq. One run of the paper's small CNN leaves
a large GPU mostly idle, and the AUROC of a run spreads by about 0.02 from
seed to seed, so the question "does the paper's recipe reach 0.95?" needs
many full runs. This script trains `--models G` independent models in one
network: every convolution is grouped (`groups=G`, model g owns channels
g*C..(g+1)*C), BatchNorm is per channel anyway, and the dense layer, DUQ's W
and the centroids carry a leading model axis. Model g sees its own shuffled
batches as input channel g. Each model's loss (BCE plus 0.05 times its own
two-sided penalty) depends only on its own parameters, so the gradient of
their sum gives each model the gradient of its own loss, and SGD with weight
decay and momentum acts element by element. Up to floating-point rounding,
this is G separate runs of `train_pytorch.py`; `--self-check` tests that
against G separate `DUQNet`s stepped on the same batches.

    python train_pytorch_grouped.py --self-check --device cpu
    python train_pytorch_grouped.py --models 16 --seed 100 --device cuda \
        --tf32 off --state-dir /tmp/grouped

Model g of a run with `--seed S` draws its own initial weights and data order
from seed `S * 1000 + g`. Logs `epochs.jsonl` (one line per model and epoch;
test accuracy and AUROC vs MNIST every 5 epochs) and is resumable from
`--state-dir`.
"""

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
import train_pytorch
from torch import nn
from train_pytorch import GAMMA
from train_pytorch import LENGTH_SCALE
from train_pytorch import NUM_CLASSES
from train_pytorch import PENALTY
from train_pytorch import DUQNet
from train_pytorch import auroc
from train_pytorch import exact_binary_cross_entropy
from train_pytorch import load_all
from train_pytorch import make_optimizer
from train_pytorch import resume
from train_pytorch import save_epoch
from train_pytorch import state_paths
from train_pytorch import steps_per_epoch

CHANNELS = (64, 128, 128)


class GroupedDUQNet(nn.Module):
    """`models` copies of `train_pytorch.DUQNet` with separate weights."""

    def __init__(self, models):
        super().__init__()
        self.models = models
        inputs = (1, *CHANNELS[:-1])
        self.conv = nn.ModuleList(
            [
                nn.Conv2d(
                    models * c_in, models * c_out, 3, padding=padding, groups=models
                )
                for c_in, c_out, padding in zip(inputs, CHANNELS, (1, 1, 0))
            ]
        )
        self.norm = nn.ModuleList([nn.BatchNorm2d(models * c) for c in CHANNELS])
        self.dense_kernel = nn.Parameter(torch.empty(models, 256, 512))
        self.dense_bias = nn.Parameter(torch.empty(models, 256))
        self.W = nn.Parameter(torch.empty(models, 256, NUM_CLASSES, 256))
        self.register_buffer("N", torch.empty(models, NUM_CLASSES))
        self.register_buffer("m", torch.empty(models, 256, NUM_CLASSES))

    @torch.no_grad()
    def load_singles(self, nets):
        """Copies the weights and state of `len(nets)` `DUQNet`s, one per model."""
        for i in range(3):
            self.conv[i].weight.copy_(torch.cat([n.conv[i].weight for n in nets]))
            self.conv[i].bias.copy_(torch.cat([n.conv[i].bias for n in nets]))
            for name in ("weight", "bias", "running_mean", "running_var"):
                getattr(self.norm[i], name).copy_(
                    torch.cat([getattr(n.norm[i], name) for n in nets])
                )
        self.dense_kernel.copy_(torch.stack([n.dense.weight for n in nets]))
        self.dense_bias.copy_(torch.stack([n.dense.bias for n in nets]))
        for name in ("W", "N", "m"):
            getattr(self, name).copy_(torch.stack([getattr(n, name) for n in nets]))

    def embed(self, x):
        """`x`: (batch, models, 28, 28), model g's image in channel g."""
        for conv, norm in zip(self.conv, self.norm):
            x = F.max_pool2d(F.relu(norm(conv(x))), 2)
        x = x.reshape(len(x), self.models, -1)  # model g's (C, H, W), flattened
        features = F.relu(
            torch.einsum("bgi,goi->bgo", x, self.dense_kernel) + self.dense_bias
        )
        return torch.einsum("bgf,gdcf->bgdc", features, self.W)

    def log_kernel(self, x):
        centroids = self.m / self.N[:, None]
        distances = ((self.embed(x) - centroids[None]) ** 2).mean(2)
        return -distances / (2 * LENGTH_SCALE**2)  # (batch, models, classes)

    def forward(self, x):
        return torch.exp(self.log_kernel(x))


def singles(models, seed, keras_like=0):
    """`DUQNet`s seeded `seed * 1000 + g`; the last `keras_like` with zero biases."""
    nets = []
    for g in range(models):
        torch.manual_seed(seed * 1000 + g)
        nets.append(DUQNet("zeros" if g >= models - keras_like else "pytorch"))
    return nets


def train_step(net, optimizer, x, labels, exact_bce):
    """One step of every model.

    `x`: (batch, models, 28, 28); `labels`: (batch, models); `exact_bce`:
    (models,) bool, which models train with `exact_binary_cross_entropy`.
    """
    x = x.clone().requires_grad_(True)
    y = F.one_hot(labels, NUM_CLASSES).to(x.dtype)
    net.train()
    optimizer.zero_grad()
    log_kernel = net.log_kernel(x)
    kernel = torch.exp(log_kernel)
    bce = torch.where(
        exact_bce[None, :, None],
        exact_binary_cross_entropy(log_kernel, y),
        F.binary_cross_entropy(kernel, y, reduction="none"),
    ).mean((0, 2))
    gradient = torch.autograd.grad(kernel.sum(), x, create_graph=True)[0]
    penalty = ((gradient.flatten(2).norm(2, dim=2) - 1) ** 2).mean(0)
    (bce + PENALTY * penalty).sum().backward()
    optimizer.step()
    with torch.no_grad():
        net.eval()
        embedded = net.embed(x.detach())
        net.N.mul_(GAMMA).add_((1 - GAMMA) * y.sum(0))
        net.m.mul_(GAMMA).add_((1 - GAMMA) * torch.einsum("bgdc,bgc->gdc", embedded, y))
    accuracy = (kernel.argmax(2) == labels).float().mean(0)
    return bce.detach(), penalty.detach(), accuracy


def synchronize(device):
    """Waits for the GPU's queued work, so that a timer reads its end."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def self_check(device):
    """G=3 grouped against three `DUQNet`s stepped by `train_pytorch.py`'s step.

    Model 2 trains with `exact_binary_cross_entropy`, the others with
    PyTorch's `binary_cross_entropy`.

    In float64: in float32 the two drift apart by rounding (about 1e-2 of a
    weight's scale after 4 steps at these steep kernels), which would hide a
    real difference.
    """
    models, batch = 3, 32
    nets = [n.to(device, torch.float64) for n in singles(models, 7, keras_like=1)]
    exact_bce = torch.tensor([False, False, True], device=device)
    generator = torch.Generator().manual_seed(0)
    x_all = torch.randn(
        4, batch, models, 28, 28, generator=generator, dtype=torch.float64
    ).to(device)
    labels_all = torch.randint(
        0, NUM_CLASSES, (4, batch, models), generator=generator
    ).to(device)
    with torch.no_grad():
        # Centroids at the first batch's mean embedding: at the random start the
        # kernel values are ~1e-20 and the BCE gradients ~1e-10, which would
        # test little more than weight decay.
        for g, net in enumerate(nets):
            net.m.copy_(net.embed(x_all[0][:, g, None]).mean(0) * net.N)
    grouped = GroupedDUQNet(models).to(device, torch.float64)
    grouped.load_singles(nets)
    initial = {k: v.clone() for k, v in grouped.state_dict().items()}
    opt_grouped, _ = make_optimizer(grouped.parameters())
    opts = [make_optimizer(n.parameters())[0] for n in nets]
    for x, labels in zip(x_all, labels_all):
        train_step(grouped, opt_grouped, x, labels, exact_bce)
        for g, (net, opt) in enumerate(zip(nets, opts)):
            train_pytorch.train_step(
                net, opt, x[:, g, None], labels[:, g], bool(exact_bce[g])
            )
    reference = GroupedDUQNet(models).to(device, torch.float64)
    reference.load_singles(nets)
    worst = 0.0
    for (name, a), b in zip(
        grouped.state_dict().items(), reference.state_dict().values()
    ):
        if a.dtype.is_floating_point:
            scale = b.abs().max().item() or 1.0
            error = (a - b).abs().max().item() / scale
            worst = max(worst, error)
            moved = (b - initial[name]).abs().max().item() / scale
            print(
                f"{name:22s} max |grouped - single| / max |single| = {error:.2e}"
                f"  (4 steps moved it by {moved:.2e})"
            )
    probe = x_all[0]
    with torch.no_grad():
        grouped.eval()
        difference = (grouped(probe) - reference.eval()(probe)).abs().max().item()
    print(f"kernel values after 4 steps: max difference {difference:.2e}")
    ok = worst < 1e-9 and difference < 1e-9
    print("self-check", "passed" if ok else "FAILED")
    return ok


@torch.no_grad()
def evaluate(net, x_test, y_test, x_ood):
    net.eval()
    models = net.models

    def kernels(images):
        return torch.cat(
            [net(x.expand(-1, models, -1, -1)) for x in images.split(1000)]
        )

    kernel_test, kernel_ood = kernels(x_test), kernels(x_ood)
    certainty_test, predictions = kernel_test.max(2)
    certainty_ood = kernel_ood.max(2)[0]
    accuracy = (predictions == y_test[:, None]).float().mean(0)
    return [
        {
            "test_accuracy": accuracy[g].item(),
            "auroc": auroc(
                certainty_test[:, g].cpu().numpy(), certainty_ood[:, g].cpu().numpy()
            ),
        }
        for g in range(models)
    ]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--state-dir")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tf32", choices=("on", "off"), default="off")
    parser.add_argument(
        "--keras-like",
        type=int,
        default=0,
        help="how many of the models (the last ones) train as keras_duq does: zero "
        "conv and dense biases, exact BCE gradient (the others: the paper's code)",
    )
    parser.add_argument("--last-batch", choices=("drop", "keep"), default="drop")
    parser.add_argument("--train-subset", type=int, default=None, help="smoke tests")
    parser.add_argument("--max-steps", type=int, default=None, help="timing only")
    parser.add_argument("--self-check", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.self_check:
        raise SystemExit(0 if self_check(device) else 1)
    torch.backends.cudnn.allow_tf32 = args.tf32 == "on"
    torch.backends.cuda.matmul.allow_tf32 = (
        False  # as train_pytorch.py (PyTorch's default)
    )
    torch.backends.cudnn.benchmark = True
    state_path, log_path = state_paths(args.state_dir)
    x_train, y_train, x_test, y_test, x_ood = load_all(device, args.train_subset)

    models = args.models
    net = GroupedDUQNet(models)
    net.load_singles(singles(models, args.seed, args.keras_like))
    net.to(device)
    exact_bce = torch.arange(models, device=device) >= models - args.keras_like
    optimizer, scheduler = make_optimizer(net.parameters())
    generators = [
        torch.Generator().manual_seed(args.seed * 1000 + g) for g in range(models)
    ]
    start_epoch, state = resume(state_path, device, net, optimizer, scheduler)
    if state is not None:
        for generator, saved in zip(generators, state["generators"]):
            generator.set_state(saved.cpu())

    batch_size = 128
    for epoch in range(start_epoch + 1, args.epochs + 1):
        started = time.perf_counter()
        orders = torch.stack(
            [torch.randperm(len(x_train), generator=g) for g in generators]
        ).to(device)
        totals = torch.zeros(3, models, device=device)
        steps = steps_per_epoch(
            len(x_train), batch_size, args.last_batch, args.max_steps
        )
        for step in range(steps):
            index = orders[
                :, step * batch_size : (step + 1) * batch_size
            ].T  # (batch, models)
            x = x_train[index][:, :, 0]  # (batch, models, 28, 28)
            if step == 5 and args.max_steps:  # time after cuDNN's autotuning
                synchronize(device)
                started = time.perf_counter()
            totals += torch.stack(
                train_step(net, optimizer, x, y_train[index], exact_bce)
            )
        if args.max_steps:
            synchronize(device)
            seconds = time.perf_counter() - started
            print(
                f"{models} models: {seconds / (steps - 5):.4f} s/step (steps 6-{steps})"
            )
            return
        scheduler.step()
        totals = (totals / steps).tolist()
        evaluation = (
            evaluate(net, x_test, y_test, x_ood)
            if epoch % 5 == 0 or epoch == args.epochs
            else [{}] * models
        )
        seconds = time.perf_counter() - started
        records = [
            {
                "epoch": epoch,
                "model": g,
                "seed": args.seed * 1000 + g,
                "bce": totals[0][g],
                "gradient_penalty": totals[1][g],
                "accuracy": totals[2][g],
                **evaluation[g],
                "device": args.device,
                "tf32": args.tf32,
                "variant": "keras_like" if exact_bce[g] else "paper_code",
                "last_batch": args.last_batch,
                "models_in_group": models,
                "seconds": seconds,
            }
            for g in range(models)
        ]
        aurocs = [r["auroc"] for r in records if "auroc" in r]
        summary = (
            f"  AUROC mean {np.mean(aurocs):.4f} min {min(aurocs):.4f}"
            if aurocs
            else ""
        )
        print(f"epoch {epoch}: {seconds:.1f} s{summary}", flush=True)
        save_epoch(
            state_path,
            log_path,
            records,
            epoch,
            net,
            optimizer,
            scheduler,
            generators=[g.get_state() for g in generators],
        )


if __name__ == "__main__":
    main()
