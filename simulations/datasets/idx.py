"""MNIST / Fashion-MNIST IDX files: locate, download on request, verify, parse, normalise.

I/O sits at the edge: :func:`load_idx_dataset` is the only function in ``simulations.datasets`` that
touches disk or the network, and it never downloads unless asked (``download=True``); nothing happens at import time.
Every file is checked against the published size and SHA-256 (``shared/data/README.md``) before it
is parsed, and the parsed header (magic, count, rows, cols) is checked against the IDX layout.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import struct
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol.errors import FedfilterError
from simulations.datasets.checks import DataParameterError


class DatasetFileError(FedfilterError, ValueError):
    """A dataset file exists but its bytes or its contents are not what was expected."""


class ChecksumMismatchError(DatasetFileError):
    """A dataset file's size or SHA-256 differs from the published value."""


class IdxFormatError(DatasetFileError):
    """A dataset file is not a valid IDX file of the expected kind (magic, dims, length, gzip)."""


class DatasetNotFoundError(FedfilterError, FileNotFoundError):
    """A dataset file is missing and was not (or could not be) downloaded."""


class DatasetDownloadError(DatasetNotFoundError):
    """A missing dataset file could not be downloaded (network unavailable, or a bad download)."""


# --------------------------------------------------------------------------------------------
# Published files (shared/data/README.md, tables "mnist/" and "fashion-mnist/")
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IdxFile:
    """One official .gz file: its name, byte size and SHA-256 (README table); ``count`` items inside."""

    filename: str
    size_bytes: int
    sha256: str
    count: int


IMAGE_MAGIC = 2051  # 0x00000803: ubyte, 3 dims (README "File layout")
LABEL_MAGIC = 2049  # 0x00000801: ubyte, 1 dim
IMAGE_ROWS = 28
IMAGE_COLS = 28
N_CLASSES = 10
SPLITS = ("train", "t10k")
_SPLIT_ALIASES = {"train": "train", "t10k": "t10k", "test": "t10k"}

# (dataset, split) -> (images file, labels file). Sizes and SHA-256 copied from shared/data/README.md.
DATASET_FILES: dict[tuple[str, str], tuple[IdxFile, IdxFile]] = {
    ("mnist", "train"): (
        IdxFile(
            "train-images-idx3-ubyte.gz",
            9912422,
            "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            60000,
        ),
        IdxFile(
            "train-labels-idx1-ubyte.gz",
            28881,
            "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            60000,
        ),
    ),
    ("mnist", "t10k"): (
        IdxFile(
            "t10k-images-idx3-ubyte.gz",
            1648877,
            "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            10000,
        ),
        IdxFile(
            "t10k-labels-idx1-ubyte.gz",
            4542,
            "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
            10000,
        ),
    ),
    ("fashion-mnist", "train"): (
        IdxFile(
            "train-images-idx3-ubyte.gz",
            26421880,
            "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
            60000,
        ),
        IdxFile(
            "train-labels-idx1-ubyte.gz",
            29515,
            "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
            60000,
        ),
    ),
    ("fashion-mnist", "t10k"): (
        IdxFile(
            "t10k-images-idx3-ubyte.gz",
            4422102,
            "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
            10000,
        ),
        IdxFile(
            "t10k-labels-idx1-ubyte.gz",
            5148,
            "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
            10000,
        ),
    ),
}
DATASETS = ("mnist", "fashion-mnist")

# Official mirrors, tried in order (torchvision's MNIST list; Zalando's S3 bucket and repository).
MIRRORS: dict[str, tuple[str, ...]] = {
    "mnist": (
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "http://yann.lecun.com/exdb/mnist/",
    ),
    "fashion-mnist": (
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    ),
}
DOWNLOAD_TIMEOUT_S = 20.0

# Per-pixel mean / std of the training images after dividing by 255.
# MNIST: the customary (0.1307, 0.3081); README "Parsed contents" gives 0.1306605 / 0.3081078.
# Fashion-MNIST: the customary (0.2860, 0.3530); README gives the mean 0.2860406 (72.940352 / 255).
NORMALISATION: dict[str, tuple[float, float]] = {
    "mnist": (0.1307, 0.3081),
    "fashion-mnist": (0.2860, 0.3530),
}

_CHUNK_BYTES = 1 << 20


# --------------------------------------------------------------------------------------------
# Locating, verifying and parsing files
# --------------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """The shared offline copy (``<repo>/../shared/data``) if it exists, else ``~/.cache/fedfilter/data``."""
    shared = Path(__file__).resolve().parents[3] / "shared" / "data"
    if shared.is_dir():
        return shared
    return Path.home() / ".cache" / "fedfilter" / "data"


def _dataset_name(name: str) -> str:
    if name not in DATASETS:
        raise DataParameterError(f"dataset: expected one of {list(DATASETS)}, got {name!r}")
    return name


def _split_name(split: str) -> str:
    if split not in _SPLIT_ALIASES:
        raise DataParameterError(f"split: expected one of {sorted(_SPLIT_ALIASES)}, got {split!r}")
    return _SPLIT_ALIASES[split]


def _label(path: Path) -> str:
    """``<dataset dir>/<file name>``, the name used in error messages."""
    return f"{path.parent.name}/{path.name}"


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def verify_file(path: Path, spec: IdxFile) -> None:
    """Raise :class:`ChecksumMismatchError` unless ``path`` has the published size and SHA-256."""
    size = path.stat().st_size
    if size != spec.size_bytes:
        raise ChecksumMismatchError(
            f"{_label(path)}: expected {spec.size_bytes} bytes, found {size} bytes: the file is not the canonical one"
        )
    found = sha256_of(path)
    if found != spec.sha256:
        raise ChecksumMismatchError(
            f"{_label(path)}: expected sha256 {spec.sha256}, found {found}: the file is not the canonical one"
        )


def _gunzip(path: Path) -> bytes:
    try:
        with gzip.open(path, "rb") as fh:
            return fh.read()
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise IdxFormatError(
            f"{_label(path)}: expected a gzip-compressed IDX file, could not decompress: {exc}"
        ) from exc


def _check_magic(path: Path, found: int, expected: int, kind: str) -> None:
    if found != expected:
        raise IdxFormatError(
            f"{_label(path)}: expected magic {expected} (0x{expected:08x}, an IDX {kind} file), "
            f"found {found} (0x{found:08x})"
        )


def read_idx_images(path: Path, *, expected_count: int | None = None) -> np.ndarray:
    """Parse a gzip IDX image file (no checksum check) into uint8 ``(n, 28, 28)``."""
    raw = _gunzip(path)
    if len(raw) < 16:
        raise IdxFormatError(f"{_label(path)}: expected a 16-byte IDX image header, found {len(raw)} bytes in all")
    magic, count, rows, cols = struct.unpack(">IIII", raw[:16])
    _check_magic(path, magic, IMAGE_MAGIC, "image")
    if (rows, cols) != (IMAGE_ROWS, IMAGE_COLS):
        raise IdxFormatError(f"{_label(path)}: expected {IMAGE_ROWS}x{IMAGE_COLS} images, found {rows}x{cols}")
    if expected_count is not None and count != expected_count:
        raise IdxFormatError(f"{_label(path)}: expected {expected_count} images, found header count {count}")
    n_bytes = count * rows * cols
    if len(raw) - 16 != n_bytes:
        raise IdxFormatError(
            f"{_label(path)}: expected {n_bytes} pixel bytes for {count} images, found {len(raw) - 16}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(count, rows, cols).copy()


def read_idx_labels(path: Path, *, expected_count: int | None = None) -> np.ndarray:
    """Parse a gzip IDX label file (no checksum check) into uint8 ``(n,)`` with values in 0..9."""
    raw = _gunzip(path)
    if len(raw) < 8:
        raise IdxFormatError(f"{_label(path)}: expected an 8-byte IDX label header, found {len(raw)} bytes in all")
    magic, count = struct.unpack(">II", raw[:8])
    _check_magic(path, magic, LABEL_MAGIC, "label")
    if expected_count is not None and count != expected_count:
        raise IdxFormatError(f"{_label(path)}: expected {expected_count} labels, found header count {count}")
    if len(raw) - 8 != count:
        raise IdxFormatError(f"{_label(path)}: expected {count} label bytes, found {len(raw) - 8}")
    labels = np.frombuffer(raw, dtype=np.uint8, offset=8).copy()
    if count and int(labels.max()) >= N_CLASSES:
        raise IdxFormatError(f"{_label(path)}: expected labels in 0..{N_CLASSES - 1}, found {int(labels.max())}")
    return labels


def _download(name: str, spec: IdxFile, dest: Path) -> None:
    """Fetch ``spec`` from the official mirrors into ``dest``, verified; raise :class:`DatasetDownloadError`."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatasetDownloadError(f"{_label(dest)}: cannot create {dest.parent} to download into: {exc}") from exc
    if not os.access(dest.parent, os.W_OK):
        raise DatasetDownloadError(f"{_label(dest)}: cannot download into {dest.parent}: the directory is not writable")
    failures: list[str] = []
    network_failed = False
    for mirror in MIRRORS[name]:
        url = mirror + spec.filename
        tmp_name: str | None = None
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{spec.filename}.", suffix=".part")
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(response, out, _CHUNK_BYTES)
            verify_file(Path(tmp_name), spec)
            os.replace(tmp_name, dest)
            tmp_name = None
            return
        except urllib.error.HTTPError as exc:  # the server answered, but not with the file
            failures.append(f"{url}: {exc}")
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            network_failed = True
            failures.append(f"{url}: {exc}")
        except (ChecksumMismatchError, OSError) as exc:
            failures.append(f"{url}: {exc}")
        finally:
            if tmp_name is not None:
                Path(tmp_name).unlink(missing_ok=True)
    cause = "the network is unavailable" if network_failed else "no mirror gave the canonical file"
    raise DatasetDownloadError(
        f"{_label(dest)}: download failed, {cause} ({'; '.join(failures)}). "
        f"Place the four official files ({', '.join(_all_filenames())}) by hand in {dest.parent}, "
        f"or point data_dir at a copy such as <repo>/../shared/data."
    )


def _all_filenames() -> list[str]:
    return [spec.filename for split in SPLITS for spec in DATASET_FILES[("mnist", split)]]


def _ensure_file(name: str, spec: IdxFile, path: Path, *, download: bool) -> None:
    if path.is_file():
        return
    if download:
        _download(name, spec, path)
        return
    raise DatasetNotFoundError(
        f"{_label(path)}: file not found at {path}. Pass download=True (--download) to fetch it from the official "
        f"mirrors, or set data_dir to the shared copy ({default_data_dir()})."
    )


def load_idx_dataset(
    name: str, data_dir: Path, *, split: str = "train", download: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Load ``name`` ("mnist" or "fashion-mnist") ``split`` ("train", "t10k" or "test") from ``data_dir/name/``.

    Returns images uint8 ``(n, 28, 28)`` and labels uint8 ``(n,)``. Each file is checked against the
    published size and SHA-256 before parsing. Downloads only when ``download=True`` and a file is missing.
    """
    name = _dataset_name(name)
    split = _split_name(split)
    image_spec, label_spec = DATASET_FILES[(name, split)]
    folder = Path(data_dir) / name
    arrays: list[np.ndarray] = []
    for spec, reader in ((image_spec, read_idx_images), (label_spec, read_idx_labels)):
        path = folder / spec.filename
        _ensure_file(name, spec, path, download=download)
        verify_file(path, spec)
        arrays.append(reader(path, expected_count=spec.count))
    images, labels = arrays
    return images, labels


def normalise_images(images: np.ndarray, *, dataset: str = "mnist") -> np.ndarray:
    """uint8 ``(n, 28, 28)`` -> float32 ``(n, 1, 28, 28)``: x / 255 standardised by ``dataset``'s mean and std."""
    mean, std = NORMALISATION[_dataset_name(dataset)]
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (IMAGE_ROWS, IMAGE_COLS):
        raise DataParameterError(
            f"images: expected uint8 of shape (n, {IMAGE_ROWS}, {IMAGE_COLS}), got {images.dtype} {images.shape}"
        )
    scaled = images.astype(np.float32) / np.float32(255.0)
    out = (scaled - np.float32(mean)) / np.float32(std)
    return out[:, None, :, :]
