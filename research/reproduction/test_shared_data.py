"""The loaders of the offline image files the benchmarks read (research/reproduction/shared_data.py)."""

import numpy as np
import pytest

from research.reproduction import shared_data


@pytest.mark.slow  # about 15 s: decodes all 60,000 JPEG images
def test_cifar10_reads_all_images_in_cifar10_label_order(cifar10_zip):
    (x_train, y_train), (x_test, y_test) = shared_data.cifar10(str(cifar10_zip))
    assert x_train.shape == (50_000, 32, 32, 3) and x_train.dtype == np.uint8
    assert x_test.shape == (10_000, 32, 32, 3)
    assert np.bincount(y_train).tolist() == [5000] * 10
    assert np.bincount(y_test).tolist() == [1000] * 10
    # Real photographs, not blank decodes: every channel varies.
    assert x_test.reshape(-1, 3).std(axis=0).min() > 30


def test_tiny_imagenet_resize_is_ten_thousand_32x32_images(tiny_imagenet_resize_path):
    x = shared_data.tiny_imagenet_resize(str(tiny_imagenet_resize_path))
    assert x.shape == (10_000, 32, 32, 3) and x.dtype == np.uint8


def _write_jpeg(path, value):
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((64, 64, 3), value, "uint8")).save(path)


def test_tiny_imagenet_200_keeps_the_first_200_classes_and_the_original_val_images(
    tmp_path,
):
    # The folder layout of Tiny-ImageNet-200, with the public copy's two extra
    # classes and their validation images (val_10000 and up) that the loader
    # leaves out.
    wnids = [f"n{i:08d}" for i in range(202)]
    (tmp_path / "wnids.txt").write_text("\n".join(wnids))
    for c, wnid in enumerate(wnids):
        for k in range(2):
            _write_jpeg(tmp_path / "train" / wnid / "images" / f"{wnid}_{k}.JPEG", c)
    lines = []
    for i, wnid in [(0, wnids[3]), (1, wnids[199]), (10_000, wnids[200])]:
        _write_jpeg(tmp_path / "val" / "images" / f"val_{i}.JPEG", 7)
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (tmp_path / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")

    (x, y), (x_val, y_val) = shared_data.tiny_imagenet_200(
        str(tmp_path), per_class=2, size=32
    )
    assert x.shape == (400, 32, 32, 3) and x.dtype == np.uint8
    assert np.bincount(y).tolist() == [2] * 200
    # Each image is its class's grey level: labels follow wnids.txt's order.
    np.testing.assert_allclose(x[:, 0, 0, 0], y, atol=2)
    assert x_val.shape == (2, 32, 32, 3) and y_val.tolist() == [3, 199]
