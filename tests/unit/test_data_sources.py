"""Data sources (workloads/data_sources.py): count, re-iterable batches, chunked fingerprint, errors."""

from __future__ import annotations

import gzip
import hashlib
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from workloads.data_sources import (
    IdxSource,
    NpyPairSource,
    NpzSource,
    TorchDatasetSource,
    materialise,
    open_source,
)


def _sha(*paths: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in paths)).hexdigest()


def _collect(source: Any, size: int) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = zip(*source.batches(size), strict=True)
    return np.concatenate(xs), np.concatenate(ys)


def _check_source(source: Any, x: np.ndarray, y: np.ndarray) -> None:
    assert len(source) == len(x)
    for size in (1, 3, len(x) + 5):  # every batch size gives the same records, every time
        got_x, got_y = _collect(source, size)
        np.testing.assert_array_equal(got_x, x)
        np.testing.assert_array_equal(got_y, y)
        assert all(len(b[0]) <= size for b in source.batches(size))
    assert source.fingerprint() == source.fingerprint()


def test_npz_keeps_todays_behaviour_and_errors(tmp_path: Path) -> None:
    x, y = np.arange(20, dtype=np.float32).reshape(10, 2), np.arange(10) % 3
    np.savez(tmp_path / "d.npz", x=x, y=y)
    source = open_source(tmp_path / "d.npz")
    assert isinstance(source, NpzSource)
    _check_source(source, x, y)
    assert source.fingerprint() == _sha(tmp_path / "d.npz")  # the ledger's data_sha256 is unchanged
    np.savez(tmp_path / "bad.npz", x=x)
    with pytest.raises(ValueError, match=r"expected arrays 'x' and 'y' in the .npz file, found \['x'\]"):
        NpzSource(tmp_path / "bad.npz")
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 truncated zip")
    with pytest.raises(ValueError, match=r"expected an .npz file with arrays 'x' and 'y'"):
        NpzSource(tmp_path / "junk.npz")
    np.savez(tmp_path / "short.npz", x=x, y=y[:3])
    with pytest.raises(ValueError, match=r"expected as many labels as records \(> 0\), got 10 and 3"):
        NpzSource(tmp_path / "short.npz")
    np.savez(tmp_path / "str.npz", x=x, y=np.array(["a"] * 10))
    with pytest.raises(ValueError, match=r"expected bool, integer or float \(at most 64-bit\) x and y, got .* and <U1"):
        NpzSource(tmp_path / "str.npz")
    # Numbers torch or the agent's bitwise selection cannot take are refused when the data is opened, not later
    # by a request (a second review: complex targets and float128 features failed only in queries).
    for name, bad_x, bad_y in (("c", x, y.astype(np.complex64)), ("q", x.astype(np.longdouble), y)):
        np.savez(tmp_path / f"{name}.npz", x=bad_x, y=bad_y)
        with pytest.raises(ValueError, match=r"at most 64-bit\) x and y, got"):
            NpzSource(tmp_path / f"{name}.npz")


@pytest.mark.parametrize("y_shape", [(12,), (12, 3)])
def test_float_regression_and_multi_output_targets(tmp_path: Path, y_shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 4)).astype(np.float32), rng.normal(size=y_shape).astype(np.float32)
    np.savez(tmp_path / "r.npz", x=x, y=y)
    _check_source(NpzSource(tmp_path / "r.npz"), x, y)
    folder = tmp_path / "pair"
    folder.mkdir()
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", y)
    _check_source(NpyPairSource(folder), x, y)


def test_npy_pair_is_memory_mapped_not_loaded_whole(tmp_path: Path) -> None:
    n, d = 5000, 64
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(n, d))
    x[:] = np.arange(n, dtype=np.float32)[:, None]
    x.flush()
    np.save(tmp_path / "y.npy", np.arange(n) % 10)
    del x
    source = open_source(tmp_path)
    assert isinstance(source, NpyPairSource)
    assert isinstance(source.x, np.memmap) and isinstance(source.y, np.memmap)  # nothing read yet
    assert len(source) == n
    first = next(iter(source.batches(7)))
    assert first[0].shape == (7, d) and not isinstance(first[0], np.memmap)  # one batch read, as a copy
    assert sum(len(b[0]) for b in source.batches(1000)) == n
    assert source.fingerprint() == _sha(tmp_path / "x.npy", tmp_path / "y.npy")
    assert isinstance(materialise(source)[0], np.memmap)  # the transitional x stays mapped
    (tmp_path / "y.npy").unlink()
    with pytest.raises(ValueError, match=r"expected x\.npy and y\.npy, found no file y\.npy"):
        NpyPairSource(tmp_path)


def _idx(path: Path, arr: np.ndarray, *, gz: bool) -> Path:
    head = struct.pack(">BBBB", 0, 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    raw = head + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


@pytest.mark.parametrize("gz", [False, True])
def test_idx_images_and_labels(tmp_path: Path, gz: bool) -> None:
    rng = np.random.default_rng(1)
    images, labels = rng.integers(0, 256, size=(9, 28, 28)), rng.integers(0, 10, size=9)
    suffix = ".gz" if gz else ""
    img = _idx(tmp_path / f"train-images-idx3-ubyte{suffix}", images, gz=gz)
    lab = _idx(tmp_path / f"train-labels-idx1-ubyte{suffix}", labels, gz=gz)
    source = open_source(img)
    assert isinstance(source, IdxSource)
    _check_source(source, images.astype(np.uint8), labels.astype(np.uint8))
    assert source.fingerprint() == _sha(img, lab)
    bad = tmp_path / "bad-images-idx3-ubyte"
    bad.write_bytes(b"\x00\x00\x99\x03")
    with pytest.raises(ValueError, match="expected an IDX header"):
        IdxSource(bad, lab)
    _idx(tmp_path / "few-labels-idx1-ubyte", labels[:4], gz=False)
    with pytest.raises(ValueError, match="expected as many labels as records"):
        IdxSource(img, tmp_path / "few-labels-idx1-ubyte")


@pytest.mark.parametrize("gz", [False, True])
def test_a_truncated_idx_file_is_refused_when_opened(tmp_path: Path, gz: bool) -> None:
    """Review finding: a file shorter than its header declares was accepted at start and failed part-way
    through a request; it is now refused when the source is opened, with what was expected and found."""
    images, labels = np.zeros((6, 28, 28)), np.zeros(6)
    suffix = ".gz" if gz else ""
    img = _idx(tmp_path / f"t-images-idx3-ubyte{suffix}", images, gz=gz)
    _idx(tmp_path / f"t-labels-idx1-ubyte{suffix}", labels, gz=gz)
    raw = gzip.decompress(img.read_bytes()) if gz else img.read_bytes()
    cut = raw[: len(raw) - 100]  # the last image loses 100 bytes
    img.write_bytes(gzip.compress(cut) if gz else cut)
    want = 16 + 6 * 28 * 28
    with pytest.raises(ValueError, match=f"expected {want} bytes for shape \\(6, 28, 28\\).*found {want - 100}"):
        IdxSource(img)


def test_idx_normalise_gives_standardised_float_images_that_the_builtin_cnn_takes(tmp_path: Path) -> None:
    """Review finding: the built-in workload opened IDX files as raw uint8, which its CNN could not take on the
    record path. With normalise=(mean, std) (what the built-in workload passes), x is float32 (b, 1, 28, 28)."""
    from client_agent.streaming import StreamedGradients
    from workloads.builtin import BUILTIN, MNIST_NORMALISATION

    rng = np.random.default_rng(2)
    images, labels = rng.integers(0, 256, size=(7, 28, 28)), rng.integers(0, 10, size=7)
    img = _idx(tmp_path / "train-images-idx3-ubyte", images, gz=False)
    _idx(tmp_path / "train-labels-idx1-ubyte", labels, gz=False)
    source = BUILTIN.open_data(img)
    x, y = _collect(source, 3)
    from simulations.datasets.idx import NORMALISATION

    assert MNIST_NORMALISATION == NORMALISATION["mnist"]  # the agent and the simulations standardise alike
    mean, std = MNIST_NORMALISATION
    want = ((images.astype(np.float32) / np.float32(255.0) - np.float32(mean)) / np.float32(std))[:, None]
    assert x.dtype == np.float32 and x.shape == (7, 1, 28, 28)
    np.testing.assert_array_equal(x, want)
    np.testing.assert_array_equal(y, labels)
    model = BUILTIN.build_model("opacus_mnist_cnn", seed=0)
    units = StreamedGradients(model, BUILTIN.loss, source, chunk_size=4)
    assert np.all(units.norms() > 0) and units.method == "rows"
    with pytest.raises(ValueError, match="normalise: expected"):
        IdxSource(img, normalise=(0.1, 0.0))


class Squares(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((2, 2), float(i)), torch.tensor([float(i * i), -1.0])


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return ((torch.tensor([float(i)]), torch.tensor(i % 2)) for i in range(self.n))


def test_torch_map_style_dataset() -> None:
    source = TorchDatasetSource(Squares(7))
    x = np.stack([np.full((2, 2), float(i), np.float32) for i in range(7)])
    y = np.array([[i * i, -1.0] for i in range(7)], np.float32)
    _check_source(source, x, y)
    assert TorchDatasetSource(Squares(7)).fingerprint() == source.fingerprint()
    assert TorchDatasetSource(Squares(8)).fingerprint() != source.fingerprint()


def test_torch_iterable_dataset_needs_its_declared_length() -> None:
    with pytest.raises(ValueError, match="expected a declared length for an IterableDataset"):
        TorchDatasetSource(Stream(5))
    source = TorchDatasetSource(Stream(5), length=5)
    _check_source(source, np.arange(5, dtype=np.float32).reshape(5, 1), np.arange(5) % 2)
    wrong = TorchDatasetSource(Stream(5), length=6)
    with pytest.raises(ValueError, match="declared 6 records, yielded 5"):
        list(wrong.batches(2))
    with pytest.raises(ValueError, match="expected a map-style Dataset with __len__"):
        TorchDatasetSource(object())


def test_batch_size_must_be_positive(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.ones((2, 1)), y=np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="expected a batch size >= 1, got 0"):
        list(NpzSource(tmp_path / "d.npz").batches(0))
