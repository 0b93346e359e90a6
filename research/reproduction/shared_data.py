"""Loaders for the image files in `../shared/data/` (see its SOURCES.md).

The user path to these data sets is tensorflow-datasets (`examples/`,
`research/reproduction/cifar10.py`); these loaders read the offline copies the
benchmarks run on, as uint8 arrays `(n, height, width, 3)` and int labels.

- `cifar10`: the JPEG zip of all 60,000 CIFAR-10 images (`cifar10_jpg.zip`),
  read in place; labels in CIFAR-10's order (its class names sorted).
- `tiny_imagenet_resize`: the 10,000 Tiny-ImageNet test images box-resized
  to 32x32 (`test_resize32.npz`), the usual OoD set for CIFAR-10.
- `tiny_imagenet_200`: Tiny-ImageNet-200 rebuilt from its public copy
  (SOURCES.md, section 4): the first 200 wnids, `per_class` training images
  of each and the validation images `val_0` .. `val_9999` as test set,
  optionally box-resized.

    git -C <copy of rangeetpan/IMagenet> archive \\
        6125d8a1069df02232eb57678fd46c700411dd45 tiny-imagenet-200 | tar -x -C DIR
"""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np

SHARED_DATA = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "data"
)


def _decode(data: bytes, size: int | None = None) -> np.ndarray:
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    if size is not None and image.size != (size, size):
        image = image.resize((size, size), Image.BOX)
    return np.asarray(image, dtype="uint8")


def cifar10(path: str | None = None):
    """Returns `(x_train, y_train), (x_test, y_test)` from the JPEG zip."""
    path = path or os.path.join(SHARED_DATA, "cifar10", "cifar10_jpg.zip")
    with zipfile.ZipFile(path) as archive:
        names = sorted(n for n in archive.namelist() if n.endswith(".jpg"))
        classes = sorted({n.split("/")[1] for n in names})
        if len(classes) != 10:
            raise ValueError(
                f"Expected the 10 CIFAR-10 class folders in {path}. Received: {classes}"
            )
        splits = {}
        for split in ("train", "test"):
            members = [n for n in names if n.startswith(split + "/")]
            x = np.stack([_decode(archive.read(n)) for n in members])
            y = np.array([classes.index(n.split("/")[1]) for n in members], "int32")
            splits[split] = (x, y)
    return splits["train"], splits["test"]


def tiny_imagenet_resize(path: str | None = None) -> np.ndarray:
    """Returns the 10,000 Tiny-ImageNet test images at 32x32, uint8."""
    path = path or os.path.join(SHARED_DATA, "tiny_imagenet", "test_resize32.npz")
    with np.load(path) as data:
        return data["x"]


def tiny_imagenet_200(directory: str, per_class: int = 500, size: int | None = None):
    """Returns `(x_train, y_train), (x_val, y_val)` of Tiny-ImageNet-200.

    Args:
        directory: the `tiny-imagenet-200` folder (module docstring).
        per_class: training images per class, the first by file number.
        size: side to box-resize to (64 keeps the originals).
    """
    with open(os.path.join(directory, "wnids.txt")) as f:
        # The public copy appends two classes the original does not have.
        wnids = [line.strip() for line in f if line.strip()][:200]
    index = {wnid: i for i, wnid in enumerate(wnids)}

    def read(path):
        with open(path, "rb") as f:
            return _decode(f.read(), size)

    x_train, y_train = [], []
    for wnid in wnids:
        for k in range(per_class):
            name = f"{wnid}_{k}.JPEG"
            x_train.append(read(os.path.join(directory, "train", wnid, "images", name)))
            y_train.append(index[wnid])
    x_val, y_val = [], []
    with open(os.path.join(directory, "val", "val_annotations.txt")) as f:
        for line in f:
            name, wnid = line.split("\t")[:2]
            if int(name.split("_")[1].split(".")[0]) >= 10_000:
                continue
            x_val.append(read(os.path.join(directory, "val", "images", name)))
            y_val.append(index[wnid])
    return (
        (np.stack(x_train), np.array(y_train, "int32")),
        (np.stack(x_val), np.array(y_val, "int32")),
    )
