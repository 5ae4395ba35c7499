"""A client's records as a data source: a public count, re-iterable batches and a fingerprint.

The protocol (:class:`workloads.registry.DataSource`): ``len(source)`` (the number of records, a
stable public count: it fixes ``n_units`` in the ledger), ``source.batches(size)`` yielding
``(x, y)`` pairs of at most ``size`` records in the same order on every call (a request reads the
data more than once), and ``source.fingerprint()`` (SHA-256 of the data, hashed in chunks, written
to the ledger as ``data_sha256`` and never sent). Targets may be integer labels ``(n,)``, float
regression targets ``(n,)`` or multi-output targets ``(n, k)``.

Sources here: :class:`NpzSource` (one ``.npz`` with ``x`` and ``y``; loaded whole, as before),
:class:`NpyPairSource` (memory-mapped ``x.npy`` and ``y.npy``: never loaded whole),
:class:`IdxSource` (MNIST's IDX format, raw or gzip; raw files memory-mapped, gzip streamed) and
:class:`TorchDatasetSource` (a user's map-style ``Dataset`` or an ``IterableDataset`` with a
declared length). :func:`open_source` picks one from a path.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

_CHUNK = 1 << 20  # bytes hashed at a time


def _check_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"batches: expected a batch size >= 1, got {size!r}")
    return size


def _hash_files(*paths: Path) -> str:
    """SHA-256 of the files' bytes in order (one file: exactly ``sha256sum`` of it), read in chunks."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _check_arrays(where: str, x: Any, y: Any) -> None:
    """Shapes and dtypes of a client's records, the same rules for every array source."""
    if x.ndim < 1 or y.ndim not in (1, 2):
        raise ValueError(
            f"data {where}: expected x with a record axis and y of shape (n,) or (n, k), got {x.shape} and {y.shape}"
        )
    if not all(a.dtype.kind in "biuf" and a.dtype.itemsize <= 8 for a in (x, y)):  # what torch and or_zero take
        raise ValueError(
            f"data {where}: expected bool, integer or float (at most 64-bit) x and y, got {x.dtype} and {y.dtype}"
        )
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"data {where}: expected as many labels as records (> 0), got {len(x)} and {len(y)}")


class ArrayBatches:
    """Batches over two indexable arrays (in memory or memory-mapped): a slice is read per batch."""

    x: Any
    y: Any

    def __len__(self) -> int:
        return len(self.x)

    def batches(self, size: int) -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
        _check_size(size)
        for start in range(0, len(self.x), size):
            yield np.asarray(self.x[start : start + size]), np.asarray(self.y[start : start + size])

    def arrays(self) -> tuple[Any, Any]:
        """The records as arrays (memory-mapped where the source is): for code that still reads x and y whole."""
        return self.x, self.y

    def fingerprint(self) -> str:
        """SHA-256 of the data (each concrete source says how it hashes)."""
        raise NotImplementedError


class NpzSource(ArrayBatches):
    """One ``.npz`` file with arrays ``x`` and ``y`` (read whole: a zip member cannot be memory-mapped)."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            raw = handle.read()
        try:
            with np.load(io.BytesIO(raw), allow_pickle=False) as data:
                if "x" not in data.files or "y" not in data.files:
                    raise ValueError(f"data {path}: expected arrays 'x' and 'y' in the .npz file, found {data.files}")
                self.x, self.y = data["x"], data["y"]
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise ValueError(f"data {path}: expected an .npz file with arrays 'x' and 'y', found: {exc}") from exc
        _check_arrays(str(path), self.x, self.y)
        self._sha256 = hashlib.sha256(raw).hexdigest()

    def fingerprint(self) -> str:
        return self._sha256


class NpyPairSource(ArrayBatches):
    """``x.npy`` and ``y.npy`` in one folder (or two paths), memory-mapped: only the rows of a batch are read."""

    def __init__(self, x_path: os.PathLike[str] | str, y_path: os.PathLike[str] | str | None = None) -> None:
        if y_path is None:
            folder = Path(x_path)
            x_path, y_path = folder / "x.npy", folder / "y.npy"
        self.paths = (Path(x_path), Path(y_path))
        for p in self.paths:
            if not p.is_file():
                raise ValueError(f"data {p.parent}: expected x.npy and y.npy, found no file {p.name}")
        try:
            self.x = np.load(self.paths[0], mmap_mode="r", allow_pickle=False)
            self.y = np.load(self.paths[1], mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise ValueError(f"data {self.paths[0].parent}: expected .npy arrays x and y, found: {exc}") from exc
        _check_arrays(str(self.paths[0].parent), self.x, self.y)

    def fingerprint(self) -> str:
        return _hash_files(*self.paths)


IDX_TYPES: dict[int, np.dtype[Any]] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def idx_header(head: bytes, where: str) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    """The element type, shape and header length of an IDX file (LeCun's MNIST format) from its first bytes."""
    if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] not in IDX_TYPES or head[3] < 1:
        raise ValueError(f"data {where}: expected an IDX header (0x00 0x00 type ndim), found {head[:4]!r}")
    ndim = head[3]
    end = 4 + 4 * ndim
    if len(head) < end:
        raise ValueError(f"data {where}: expected a {end}-byte IDX header, found {len(head)} bytes")
    shape = struct.unpack(f">{ndim}I", head[4:end])
    return IDX_TYPES[head[2]], tuple(int(s) for s in shape), end


class IdxSource:
    """MNIST-format IDX images and labels (``*-images-idx3-ubyte[.gz]`` and ``*-labels-idx1-ubyte[.gz]``).

    Raw files are memory-mapped; gzip files are streamed batch by batch (decompressed again on each
    pass, never whole). ``x`` is the images as stored (uint8 0..255), or with ``normalise=(mean,
    std)`` float32 ``(b, 1, rows, cols)`` images ``(x / 255 - mean) / std`` (torchvision's
    ``ToTensor`` then ``Normalize``); ``y`` the labels. A file shorter than its header says is
    refused when the source is opened, not part-way through a request.
    """

    def __init__(
        self,
        images: os.PathLike[str] | str,
        labels: os.PathLike[str] | str | None = None,
        *,
        normalise: tuple[float, float] | None = None,
    ) -> None:
        self.images = Path(images)
        if labels is None:
            if "images-idx3" not in self.images.name:
                raise ValueError(f"data {images}: expected an IDX images file named '*images-idx3*', got {images}")
            labels = self.images.with_name(self.images.name.replace("images-idx3", "labels-idx1"))
        self.labels = Path(labels)
        if normalise is not None:
            if len(normalise) != 2:
                raise ValueError(f"normalise: expected (mean, std), got {normalise!r}")
            mean, std = (float(v) for v in normalise)
            if not (np.isfinite(mean) and np.isfinite(std) and std > 0):
                raise ValueError(f"normalise: expected (mean, std) finite with std > 0, got {normalise!r}")
            self.normalise: tuple[float, float] | None = (mean, std)
        else:
            self.normalise = None
        self._x_head = self._header(self.images)
        self._y_head = self._header(self.labels)
        n_x, n_y = self._x_head[1][0], self._y_head[1][0]
        if n_x != n_y or n_x == 0:
            raise ValueError(f"data {images}: expected as many labels as records (> 0), got {n_x} and {n_y}")
        if len(self._y_head[1]) != 1:
            raise ValueError(f"data {labels}: expected a 1-d IDX label file, got shape {self._y_head[1]}")
        if self.normalise is not None and len(self._x_head[1]) != 3:
            raise ValueError(f"data {images}: normalise expects (n, rows, cols) images, got shape {self._x_head[1]}")
        for path, head in ((self.images, self._x_head), (self.labels, self._y_head)):
            self._check_length(path, head)

    def _check_length(self, path: Path, head: tuple[np.dtype[Any], tuple[int, ...], int]) -> None:
        """The file holds exactly the bytes its header declares (a gzip file is read through once)."""
        dtype, shape, offset = head
        want = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if path.suffix != ".gz":
            got = path.stat().st_size
        else:
            got = 0
            with gzip.open(path, "rb") as handle:
                while block := handle.read(1 << 20):
                    got += len(block)
        if got != want:
            raise ValueError(f"data {path}: expected {want} bytes for shape {shape} (IDX header), found {got}")

    @staticmethod
    def _open(path: Path) -> Any:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")

    def _header(self, path: Path) -> tuple[np.dtype[Any], tuple[int, ...], int]:
        if not path.is_file():
            raise ValueError(f"data {path}: expected an IDX file, found nothing")
        with self._open(path) as handle:
            head = handle.read(4)
            head += handle.read(4 * (head[3] if len(head) == 4 else 0))
        return idx_header(head, str(path))

    def __len__(self) -> int:
        return self._x_head[1][0]

    def _stream(self, path: Path, head: tuple[np.dtype[Any], tuple[int, ...], int], size: int) -> Iterator[Any]:
        dtype, shape, offset = head
        per = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        n = shape[0]
        if path.suffix != ".gz":
            data = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
            for start in range(0, n, size):
                yield np.asarray(data[start : start + size]).astype(dtype.newbyteorder("="))
            return
        with gzip.open(path, "rb") as handle:
            handle.read(offset)
            for start in range(0, n, size):
                count = min(size, n - start)
                raw = handle.read(count * per)
                if len(raw) != count * per:
                    raise ValueError(f"data {path}: expected {n} records, the file ends early")
                arr = np.frombuffer(raw, dtype=dtype).reshape(count, *shape[1:])
                yield arr.astype(dtype.newbyteorder("="))

    def batches(self, size: int) -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
        _check_size(size)
        for x, y in zip(
            self._stream(self.images, self._x_head, size), self._stream(self.labels, self._y_head, size), strict=True
        ):
            if self.normalise is not None:
                mean, std = self.normalise
                x = ((x.astype(np.float32) / np.float32(255.0) - np.float32(mean)) / np.float32(std))[:, None]
            yield x, y

    def fingerprint(self) -> str:
        return _hash_files(self.images, self.labels)


class TorchDatasetSource:
    """A user's torch ``Dataset`` (map-style, with ``__len__``) or ``IterableDataset`` with a declared length.

    Each item is an ``(x, y)`` pair, or a mapping with the keys ``"x"`` and ``"y"`` (other keys are
    ignored); each of x and y a tensor, an array or a number. A batch stacks them. Anything else is an
    error naming the item and what was expected. The fingerprint hashes every record's
    bytes, shape and dtype in order (one pass of batches). An iterable dataset that yields another
    number of records than declared is an error (the count is public and fixes the ledger's units).
    """

    def __init__(self, dataset: Any, *, length: int | None = None) -> None:
        from torch.utils.data import IterableDataset

        self.dataset = dataset
        self.iterable = isinstance(dataset, IterableDataset)
        if self.iterable:
            if length is None:
                raise ValueError(
                    f"data: expected a declared length for an IterableDataset ({type(dataset).__name__}), got none"
                )
        elif length is None:
            if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
                raise ValueError(f"data: expected a map-style Dataset with __len__, got {type(dataset).__name__}")
            length = len(dataset)
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"data: expected a record count >= 1, got {length!r}")
        self.length = length

    def __len__(self) -> int:
        return self.length

    def _items(self) -> Iterator[Any]:
        if not self.iterable:
            for i in range(self.length):
                yield self.dataset[i]
            return
        count = 0
        for item in self.dataset:
            count += 1
            if count > self.length:
                break
            yield item
        if count != self.length:
            raise ValueError(f"data: the IterableDataset declared {self.length} records, yielded {count}")

    def batches(self, size: int) -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
        _check_size(size)
        xs: list[Any] = []
        ys: list[Any] = []
        for k, item in enumerate(self._items()):
            x, y = _pair(item, k)
            xs.append(np.asarray(x))
            ys.append(np.asarray(y))
            if len(xs) == size:
                yield np.stack(xs), np.stack(ys)
                xs, ys = [], []
        if xs:
            yield np.stack(xs), np.stack(ys)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for x, y in self.batches(256):
            for arr in (x, y):
                arr = np.ascontiguousarray(arr)
                h.update(f"{arr.dtype.str}|{arr.shape[1:]}|".encode())
                h.update(arr.tobytes())
        return h.hexdigest()


def _pair(item: Any, k: int) -> tuple[Any, Any]:
    """A dataset item as (x, y): a pair, or a mapping with keys "x" and "y"."""
    from collections.abc import Mapping

    if isinstance(item, Mapping):
        if "x" not in item or "y" not in item:
            raise ValueError(f"data: item {k}: expected a mapping with keys 'x' and 'y', got keys {sorted(item)[:8]}")
        return item["x"], item["y"]
    if isinstance(item, tuple | list) and len(item) == 2:
        return item[0], item[1]
    got = f"a {type(item).__name__} of length {len(item)}" if isinstance(item, tuple | list) else type(item).__name__
    raise ValueError(f"data: item {k}: expected an (x, y) pair or a mapping with keys 'x' and 'y', got {got}")


def open_source(
    path: os.PathLike[str] | str, *, normalise: tuple[float, float] | None = None
) -> ArrayBatches | IdxSource:
    """The source a path names: a folder with ``x.npy``/``y.npy``, an IDX images file (``normalise``: see
    :class:`IdxSource`), or else an ``.npz``."""
    p = Path(path)
    if p.is_dir():
        return NpyPairSource(p)
    if "idx3-ubyte" in p.name:
        return IdxSource(p, normalise=normalise)
    return NpzSource(p)


def materialise(source: Any) -> tuple[NDArray[Any], NDArray[Any]]:
    """The records as two arrays: the source's own (possibly memory-mapped) arrays, or all batches stacked.

    For code that still reads ``x`` and ``y`` whole (transitional); streaming code uses ``batches``.
    """
    arrays = getattr(source, "arrays", None)
    if callable(arrays):
        x, y = arrays()
        return x, y
    xs, ys = zip(*source.batches(4096), strict=True)
    x, y = np.concatenate(xs), np.concatenate(ys)
    _check_arrays(type(source).__name__, x, y)
    return x, y
