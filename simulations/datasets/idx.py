"""Datasets for the simulations: MNIST / Fashion-MNIST IDX files, client partitions, synthetic data.

I/O sits at the edge: :func:`load_idx_dataset` is the only function here that touches disk or the
network, and it never downloads unless asked (``download=True``); nothing happens at import time.
Every file is checked against the published size and SHA-256 (``shared/data/README.md``) before it
is parsed, and the parsed header (magic, count, rows, cols) is checked against the IDX layout.
"""

from __future__ import annotations

import gzip
import hashlib
import math
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

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class DataParameterError(ValueError):
    """A data or partition parameter is unknown, non-finite or out of range."""


class DatasetFileError(ValueError):
    """A dataset file exists but its bytes or its contents are not what was expected."""


class ChecksumMismatchError(DatasetFileError):
    """A dataset file's size or SHA-256 differs from the published value."""


class IdxFormatError(DatasetFileError):
    """A dataset file is not a valid IDX file of the expected kind (magic, dims, length, gzip)."""


class DatasetNotFoundError(FileNotFoundError):
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
    shared = Path(__file__).resolve().parents[1].parent / "shared" / "data"
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


# --------------------------------------------------------------------------------------------
# Partitions into clients
# --------------------------------------------------------------------------------------------


def _int_at_least(name: str, value: object, lower: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise DataParameterError(f"{name}: expected an int >= {lower}, got {value!r} ({type(value).__name__})")
    if int(value) < lower:
        raise DataParameterError(f"{name}: expected an int >= {lower}, got {value!r}")
    return int(value)


def _finite_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise DataParameterError(f"{name}: expected a finite number > 0, got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out) or out <= 0.0:
        raise DataParameterError(f"{name}: expected a finite number > 0, got {value!r}")
    return out


def partition_iid(n_items: int, n_clients: int, *, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(n_items)`` into ``n_clients`` disjoint sorted int64 arrays whose sizes differ by at most 1."""
    n_items = _int_at_least("n_items", n_items, 0)
    n_clients = _int_at_least("n_clients", n_clients, 1)
    if n_items < n_clients:
        raise DataParameterError(f"n_items: expected at least n_clients={n_clients} items, got {n_items}")
    perm = np.random.default_rng(seed).permutation(n_items).astype(np.int64)
    return [np.sort(part) for part in np.array_split(perm, n_clients)]


_DIRICHLET_MAX_TRIES = 1000


def partition_dirichlet(
    labels: np.ndarray, n_clients: int, *, alpha: float, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """Label-skewed split: each class is divided among clients in Dirichlet(alpha) proportions.

    The per-class Dirichlet split of Hsu, Qi & Brown (2019, arXiv:1909.06335), as implemented in
    FedMA / NIID-Bench (Li et al. 2022): a client already holding ``n / n_clients`` items gets no
    further share, and the draw is repeated until every client has at least ``min_size`` items.
    Small ``alpha`` gives few classes per client; large ``alpha`` approaches IID. Returns disjoint
    sorted int64 index arrays covering ``range(len(labels))``; deterministic given ``seed``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataParameterError(f"labels: expected a 1-D integer array, got {labels.dtype} {labels.shape}")
    n_clients = _int_at_least("n_clients", n_clients, 1)
    alpha = _finite_positive("alpha", alpha)
    min_size = _int_at_least("min_size", min_size, 0)
    n_items = labels.shape[0]
    if n_items < n_clients * min_size:
        raise DataParameterError(
            f"min_size: expected n_clients * min_size <= {n_items} items, got {n_clients} * {min_size}"
        )
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    cap = n_items / n_clients
    for _ in range(_DIRICHLET_MAX_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        sizes = np.zeros(n_clients, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            share = rng.dirichlet(np.full(n_clients, alpha))
            open_clients = sizes < cap
            share = np.where(open_clients, share, 0.0)
            total = share.sum()
            if not np.isfinite(total) or total <= 0.0:  # tiny alpha can underflow every open share to 0
                share, total = open_clients.astype(np.float64), float(open_clients.sum())
            cuts = (np.cumsum(share / total) * len(idx)).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
                sizes[client] += len(chunk)
        if sizes.min() >= min_size:
            return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
    raise DataParameterError(
        f"min_size: no Dirichlet(alpha={alpha}) split of {n_items} items over {n_clients} clients gave every client "
        f">= {min_size} items in {_DIRICHLET_MAX_TRIES} draws; lower min_size or n_clients, or raise alpha"
    )


# --------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------


def synthetic_classification(
    n: int, d: int, n_classes: int, *, seed: int, separation: float
) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs: balanced labels, class means at distance ``separation`` from 0, unit-variance noise.

    Returns ``X`` float32 ``(n, d)`` and ``y`` int64 ``(n,)``; a (softmax) logistic regression learns it
    well once ``separation`` is a few noise standard deviations.
    """
    n = _int_at_least("n", n, 1)
    d = _int_at_least("d", d, 1)
    n_classes = _int_at_least("n_classes", n_classes, 2)
    separation = _finite_positive("separation", separation)
    if n < n_classes:
        raise DataParameterError(f"n: expected at least n_classes={n_classes} samples, got {n}")
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((n_classes, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    means = separation * directions
    y = rng.permutation(np.arange(n) % n_classes).astype(np.int64)
    x = means[y] + rng.standard_normal((n, d))
    return x.astype(np.float32), y


# Number of positives per unit, s in 1..s_max: name -> unnormalised weight of s.
DENSITY_PROFILES = ("heavy_tailed", "uniform", "constant")


def _positives_per_unit(n_units: int, s_max: int, profile: str, rng: np.random.Generator) -> np.ndarray:
    s = np.arange(1, s_max + 1)
    if profile == "heavy_tailed":
        weights = s.astype(np.float64) ** -2.0  # P(s) ∝ s^-2 on 1..s_max: median 1, a few units reach s_max
    elif profile == "uniform":
        weights = np.ones(s_max)
    elif profile == "constant":
        return np.full(n_units, s_max, dtype=np.int64)
    else:
        raise DataParameterError(f"density_profile: expected one of {list(DENSITY_PROFILES)}, got {profile!r}")
    return rng.choice(s, size=n_units, p=weights / weights.sum())


def sparse_indicator_data(
    n_units: int, k_queries: int, s_max: int, *, seed: int, density_profile: str = "heavy_tailed"
) -> np.ndarray:
    """uint8 ``(n_units, k_queries)`` 0/1 matrix; row ``i`` is positive on ``s_i <= s_max`` random queries.

    Models the sparse adaptive counting queries of Feldman & Zrnic (2021), Thm 1.2: a unit's
    individual privacy loss grows with the number of queries it is positive on, so with a
    heavy-tailed ``s_i`` most units spend far less than the worst case ``s_max``.
    Profiles: "heavy_tailed" (P(s) ∝ s^-2 on 1..s_max), "uniform" (on 1..s_max), "constant" (all s_max).
    """
    n_units = _int_at_least("n_units", n_units, 1)
    k_queries = _int_at_least("k_queries", k_queries, 1)
    s_max = _int_at_least("s_max", s_max, 1)
    if s_max > k_queries:
        raise DataParameterError(f"s_max: expected s_max <= k_queries={k_queries}, got {s_max}")
    rng = np.random.default_rng(seed)
    counts = _positives_per_unit(n_units, s_max, density_profile, rng)
    data = np.zeros((n_units, k_queries), dtype=np.uint8)
    for row, count in enumerate(counts):
        data[row, rng.choice(k_queries, size=int(count), replace=False)] = 1
    return data


def mnist_silos(
    clients: int,
    *,
    seed: int,
    data_dir: Path | None = None,
    download: bool = False,
    train_limit: int | None = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
    """MNIST split iid over ``clients`` silos: ``(parts, test_x, test_y)``, images normalised to (n, 1, 28, 28).

    ``train_limit`` keeps that many training records, drawn with ``seed`` (small test versions).
    """
    data_dir = data_dir or default_data_dir()
    train_x, train_y = load_idx_dataset("mnist", data_dir, split="train", download=download)
    test_x, test_y = load_idx_dataset("mnist", data_dir, split="test", download=download)
    if train_limit is not None:
        limit = _int_at_least("train_limit", train_limit, 1)
        keep = np.sort(np.random.default_rng(seed).permutation(len(train_x))[:limit])
        train_x, train_y = train_x[keep], train_y[keep]
    train_x = normalise_images(train_x, dataset="mnist")
    parts = [(train_x[idx], train_y[idx]) for idx in partition_iid(len(train_x), clients, seed=seed)]
    return parts, normalise_images(test_x, dataset="mnist"), test_y
