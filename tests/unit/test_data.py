"""Tests for simulations/datasets/: IDX loading against shared/data/README.md, partitions, synthetic data."""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import shutil
import struct
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from simulations.datasets.checks import DataParameterError
from simulations.datasets.idx import (
    DATASET_FILES,
    ChecksumMismatchError,
    DatasetDownloadError,
    DatasetNotFoundError,
    IdxFormatError,
    default_data_dir,
    load_idx_dataset,
    normalise_images,
    read_idx_images,
    read_idx_labels,
)
from simulations.datasets.partition import partition_dirichlet, partition_iid
from simulations.datasets.synthetic import sparse_indicator_data, synthetic_classification

DATA_DIR = default_data_dir()
requires_data = pytest.mark.skipif(
    not (DATA_DIR / "mnist").is_dir() or not (DATA_DIR / "fashion-mnist").is_dir(),
    reason=f"offline MNIST/Fashion-MNIST copy not found under {DATA_DIR} (expected <repo>/../shared/data)",
)

# shared/data/README.md, "Parsed contents".
MNIST_TRAIN_LABEL_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_LABEL_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
MNIST_TRAIN_PIXEL_MEAN = 33.318421
FASHION_TRAIN_PIXEL_MEAN = 72.940352


@pytest.fixture(scope="module")
def mnist_train() -> tuple[np.ndarray, np.ndarray]:
    return load_idx_dataset("mnist", DATA_DIR, split="train")


def _write_gz(path: Path, payload: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(payload))
    return path


# ---------------------------------------------------------------- the shared copy (README numbers)


@requires_data
def test_mnist_train_matches_readme(mnist_train: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = mnist_train
    assert images.shape == (60000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (60000,) and labels.dtype == np.uint8
    assert np.bincount(labels, minlength=10).tolist() == MNIST_TRAIN_LABEL_COUNTS
    assert images.mean() == pytest.approx(MNIST_TRAIN_PIXEL_MEAN, abs=5e-7)
    assert images.flags.writeable


@requires_data
def test_mnist_t10k_matches_readme() -> None:
    images, labels = load_idx_dataset("mnist", DATA_DIR, split="t10k")
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    assert np.bincount(labels, minlength=10).tolist() == MNIST_TEST_LABEL_COUNTS
    test_images, test_labels = load_idx_dataset("mnist", DATA_DIR, split="test")  # alias
    assert np.array_equal(test_images, images) and np.array_equal(test_labels, labels)


@requires_data
def test_fashion_mnist_train_matches_readme() -> None:
    images, labels = load_idx_dataset("fashion-mnist", DATA_DIR, split="train")
    assert images.shape == (60000, 28, 28)
    assert np.bincount(labels, minlength=10).tolist() == [6000] * 10
    assert images.mean() == pytest.approx(FASHION_TRAIN_PIXEL_MEAN, abs=5e-7)


@requires_data
def test_normalise_images_standardises_mnist(mnist_train: tuple[np.ndarray, np.ndarray]) -> None:
    out = normalise_images(mnist_train[0][:20000])
    assert out.shape == (20000, 1, 28, 28) and out.dtype == np.float32
    full = normalise_images(mnist_train[0])
    assert float(full.mean()) == pytest.approx(0.0, abs=1e-3)
    assert float(full.std()) == pytest.approx(1.0, abs=1e-3)


def test_normalise_images_uses_fashion_constants_and_rejects_bad_input() -> None:
    images = np.full((2, 28, 28), 255, dtype=np.uint8)
    # MNIST (0.1307, 0.3081): Opacus's examples/mnist.py and ../shared/data/README.md. Fashion-MNIST
    # (0.2860, 0.3530): mean and std of the shared training file's pixels / 255 (0.28604, 0.35302).
    assert normalise_images(images, dataset="fashion-mnist")[0, 0, 0, 0] == pytest.approx((1 - 0.2860) / 0.3530)
    assert normalise_images(images)[0, 0, 0, 0] == pytest.approx((1 - 0.1307) / 0.3081)
    with pytest.raises(DataParameterError, match=re.escape("images: expected uint8 of shape (n, 28, 28), got")):
        normalise_images(images.astype(np.float32))
    with pytest.raises(DataParameterError, match="dataset: expected one of"):
        normalise_images(images, dataset="cifar10")


# ---------------------------------------------------------------- verification and format errors


@requires_data
def test_tampered_label_file_fails_checksum(tmp_path: Path) -> None:
    src = DATA_DIR / "mnist"
    dst = tmp_path / "mnist"
    dst.mkdir()
    (dst / "train-images-idx3-ubyte.gz").symlink_to(src / "train-images-idx3-ubyte.gz")
    tampered = dst / "train-labels-idx1-ubyte.gz"
    shutil.copyfile(src / "train-labels-idx1-ubyte.gz", tampered)
    data = bytearray(tampered.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tampered.write_bytes(bytes(data))
    found = hashlib.sha256(data).hexdigest()
    expected = "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"
    message = (
        f"mnist/train-labels-idx1-ubyte.gz: expected sha256 {expected}, found {found}: "
        "the file is not the canonical one"
    )
    with pytest.raises(ChecksumMismatchError, match=f"^{re.escape(message)}$"):
        load_idx_dataset("mnist", tmp_path, split="train")


@requires_data
def test_truncated_file_fails_size_check(tmp_path: Path) -> None:
    dst = tmp_path / "mnist"
    dst.mkdir()
    (dst / "t10k-images-idx3-ubyte.gz").write_bytes(
        (DATA_DIR / "mnist" / "t10k-images-idx3-ubyte.gz").read_bytes()[:-1]
    )
    message = (
        "mnist/t10k-images-idx3-ubyte.gz: expected 1648877 bytes, found 1648876 bytes: "
        "the file is not the canonical one"
    )
    with pytest.raises(ChecksumMismatchError, match=f"^{re.escape(message)}$"):
        load_idx_dataset("mnist", tmp_path, split="t10k")


def test_wrong_magic_is_rejected(tmp_path: Path) -> None:
    path = _write_gz(
        tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz", struct.pack(">IIII", 2049, 1, 28, 28) + bytes(784)
    )
    message = (
        "mnist/t10k-images-idx3-ubyte.gz: expected magic 2051 (0x00000803, an IDX image file), found 2049 (0x00000801)"
    )
    with pytest.raises(IdxFormatError, match=f"^{re.escape(message)}$"):
        read_idx_images(path)
    labels = _write_gz(tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz", struct.pack(">II", 2051, 2) + bytes(2))
    with pytest.raises(
        IdxFormatError, match=re.escape("expected magic 2049 (0x00000801, an IDX label file), found 2051")
    ):
        read_idx_labels(labels)


def test_parser_checks_dims_counts_lengths_and_gzip(tmp_path: Path) -> None:
    ok = _write_gz(tmp_path / "d" / "ok.gz", struct.pack(">IIII", 2051, 2, 28, 28) + bytes(range(256)) * 6 + bytes(32))
    assert read_idx_images(ok).shape == (2, 28, 28)
    with pytest.raises(IdxFormatError, match=re.escape("d/ok.gz: expected 3 images, found header count 2")):
        read_idx_images(ok, expected_count=3)
    dims = _write_gz(tmp_path / "d" / "dims.gz", struct.pack(">IIII", 2051, 1, 32, 32) + bytes(1024))
    with pytest.raises(IdxFormatError, match=re.escape("d/dims.gz: expected 28x28 images, found 32x32")):
        read_idx_images(dims)
    short = _write_gz(tmp_path / "d" / "short.gz", struct.pack(">IIII", 2051, 2, 28, 28) + bytes(784))
    with pytest.raises(IdxFormatError, match=re.escape("expected 1568 pixel bytes for 2 images, found 784")):
        read_idx_images(short)
    bad_label = _write_gz(tmp_path / "d" / "lab.gz", struct.pack(">II", 2049, 2) + bytes([3, 10]))
    with pytest.raises(IdxFormatError, match=re.escape("d/lab.gz: expected labels in 0..9, found 10")):
        read_idx_labels(bad_label)
    not_gz = tmp_path / "d" / "plain.gz"
    not_gz.write_bytes(struct.pack(">II", 2049, 0))
    with pytest.raises(IdxFormatError, match=re.escape("d/plain.gz: expected a gzip-compressed IDX file")):
        read_idx_labels(not_gz)


def test_missing_file_names_path_and_remedy(tmp_path: Path) -> None:
    missing = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    with pytest.raises(DatasetNotFoundError) as info:
        load_idx_dataset("mnist", tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    text = str(info.value)
    assert str(missing) in text and "download=True (--download)" in text and "shared copy" in text


def test_unknown_dataset_and_split_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(
        DataParameterError, match=re.escape("dataset: expected one of ['mnist', 'fashion-mnist'], got 'kmnist'")
    ):
        load_idx_dataset("kmnist", tmp_path)
    with pytest.raises(
        DataParameterError, match=re.escape("split: expected one of ['t10k', 'test', 'train'], got 'val'")
    ):
        load_idx_dataset("mnist", tmp_path, split="val")


# ---------------------------------------------------------------- download (never touches the network here)


def test_download_without_network_gives_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def offline(url: str, timeout: float) -> object:
        calls.append(url)
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DatasetDownloadError) as info:
        load_idx_dataset("mnist", tmp_path, split="t10k", download=True)
    text = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert text.startswith("mnist/t10k-images-idx3-ubyte.gz: download failed, the network is unavailable")
    assert "by hand in " + str(tmp_path / "mnist") in text
    assert len(calls) == 2 and all(url.endswith("/t10k-images-idx3-ubyte.gz") for url in calls)
    assert list((tmp_path / "mnist").iterdir()) == []  # no partial files left behind


@requires_data
def test_download_verifies_and_installs_canonical_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def from_shared(url: str, timeout: float) -> io.BytesIO:
        return io.BytesIO((DATA_DIR / "mnist" / url.rsplit("/", 1)[1]).read_bytes())

    monkeypatch.setattr(urllib.request, "urlopen", from_shared)
    images, labels = load_idx_dataset("mnist", tmp_path, split="t10k", download=True)
    assert images.shape == (10000, 28, 28)
    assert np.bincount(labels, minlength=10).tolist() == MNIST_TEST_LABEL_COUNTS
    assert sorted(p.name for p in (tmp_path / "mnist").iterdir()) == sorted(
        spec.filename for spec in DATASET_FILES[("mnist", "t10k")]
    )


def test_download_rejects_non_canonical_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"<html>not found</html>"))
    with pytest.raises(DatasetDownloadError, match="download failed, no mirror gave the canonical file"):
        load_idx_dataset("fashion-mnist", tmp_path, split="t10k", download=True)
    assert list((tmp_path / "fashion-mnist").iterdir()) == []


# ---------------------------------------------------------------- partitions


def _assert_disjoint_cover(parts: list[np.ndarray], n_items: int) -> None:
    joined = np.concatenate(parts)
    assert joined.dtype == np.int64
    assert np.array_equal(np.sort(joined), np.arange(n_items))


def test_partition_iid_is_disjoint_covering_balanced_and_deterministic() -> None:
    parts = partition_iid(1003, 10, seed=7)
    assert len(parts) == 10
    _assert_disjoint_cover(parts, 1003)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    again = partition_iid(1003, 10, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = partition_iid(1003, 10, seed=8)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    with pytest.raises(DataParameterError, match=re.escape("n_items: expected at least n_clients=10 items, got 9")):
        partition_iid(9, 10, seed=0)
    with pytest.raises(DataParameterError, match=re.escape("n_clients: expected an int >= 1, got 0")):
        partition_iid(9, 0, seed=0)


def _max_class_share(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    return float(np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]))


def test_partition_dirichlet_skew_min_size_and_determinism() -> None:
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 600))
    skewed = partition_dirichlet(labels, 30, alpha=0.1, seed=1, min_size=10)
    _assert_disjoint_cover(skewed, labels.size)
    assert min(len(p) for p in skewed) >= 10
    assert _max_class_share(labels, skewed) > 0.5
    near_iid = partition_dirichlet(labels, 30, alpha=100.0, seed=1)
    _assert_disjoint_cover(near_iid, labels.size)
    assert _max_class_share(labels, near_iid) < 0.25
    again = partition_dirichlet(labels, 30, alpha=0.1, seed=1, min_size=10)
    assert all(np.array_equal(a, b) for a, b in zip(skewed, again, strict=True))


def test_partition_dirichlet_rejects_bad_parameters() -> None:
    labels = np.repeat(np.arange(10), 10)
    with pytest.raises(DataParameterError, match=re.escape("alpha: expected a finite number > 0, got 0.0")):
        partition_dirichlet(labels, 5, alpha=0.0, seed=0)
    with pytest.raises(DataParameterError, match=re.escape("alpha: expected a finite number > 0, got nan")):
        partition_dirichlet(labels, 5, alpha=float("nan"), seed=0)
    with pytest.raises(DataParameterError, match=re.escape("min_size: expected n_clients * min_size <= 100 items")):
        partition_dirichlet(labels, 5, alpha=1.0, seed=0, min_size=21)
    with pytest.raises(DataParameterError, match=re.escape("labels: expected a 1-D integer array")):
        partition_dirichlet(labels.astype(np.float64), 5, alpha=1.0, seed=0)


# ---------------------------------------------------------------- synthetic data


def test_synthetic_classification_is_learnable_by_logistic_regression() -> None:
    x, y = synthetic_classification(3000, 20, 5, seed=3, separation=4.0)
    assert x.shape == (3000, 20) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.bincount(y).tolist() == [600] * 5
    x2, y2 = synthetic_classification(3000, 20, 5, seed=3, separation=4.0)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    # Softmax regression by plain gradient descent.
    w, b = np.zeros((20, 5)), np.zeros(5)
    onehot = np.eye(5)[y]
    for _ in range(200):
        logits = x @ w + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        w -= 0.5 * x.T @ (p - onehot) / len(y)
        b -= 0.5 * (p - onehot).mean(axis=0)
    assert np.mean((x @ w + b).argmax(axis=1) == y) > 0.9
    with pytest.raises(DataParameterError, match=re.escape("separation: expected a finite number > 0, got -1.0")):
        synthetic_classification(10, 2, 2, seed=0, separation=-1.0)


def test_sparse_indicator_data_respects_s_max_and_is_heavy_tailed() -> None:
    data = sparse_indicator_data(5000, 200, 40, seed=11)
    assert data.shape == (5000, 200) and data.dtype == np.uint8
    assert set(np.unique(data).tolist()) <= {0, 1}
    per_unit = data.sum(axis=1, dtype=np.int64)
    assert per_unit.min() >= 1 and per_unit.max() <= 40
    assert np.median(per_unit) <= 2 and np.mean(per_unit <= 4) > 0.8  # most units far below s_max
    assert np.array_equal(data, sparse_indicator_data(5000, 200, 40, seed=11))
    constant = sparse_indicator_data(50, 20, 7, seed=0, density_profile="constant")
    assert (constant.sum(axis=1) == 7).all()
    uniform = sparse_indicator_data(2000, 20, 7, seed=0, density_profile="uniform").sum(axis=1)
    assert uniform.max() <= 7 and set(np.unique(uniform).tolist()) == set(range(1, 8))
    with pytest.raises(DataParameterError, match=re.escape("s_max: expected s_max <= k_queries=20, got 21")):
        sparse_indicator_data(5, 20, 21, seed=0)
    with pytest.raises(DataParameterError, match=re.escape("density_profile: expected one of")):
        sparse_indicator_data(5, 20, 3, seed=0, density_profile="zipf")
