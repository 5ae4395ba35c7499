"""Decode ``.npz`` archives that another party wrote, at a cost bounded by the archive's own size.

Two places read archives they did not write in this process: the agent's socket (frames from the
ClientApp proxy, which a hostile app bundle controls) and the ledger (release and state blobs,
which a damaged or planted file controls). Both go through :func:`load_stored`:

- at most ``max_members`` members, each a *stored* (never compressed) ``.npy`` file, so nothing
  inflates: the decoded arrays take at most the archive's own bytes (a decompression bomb, a
  1 MiB blob declaring 1 GiB, is refused before anything is allocated);
- each member's declared shape and dtype must match its bytes exactly, and hold no Python objects;
- every array is read once, from the archive's own buffer.

``np.savez`` (not ``savez_compressed``) writes exactly such archives. This module imports numpy
and the standard library only (the app bundle's proxy imports it).
"""

from __future__ import annotations

import io
import zipfile
from typing import Any

import numpy as np
from numpy.typing import NDArray

from protocol.errors import FedfilterError


class ArchiveError(FedfilterError, ValueError):
    """An archive that is not a plain stored ``.npz`` whose members' headers match their bytes."""


def _member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, what: str) -> NDArray[Any]:
    raw = archive.read(info)  # stored: at most the archive's own size
    buf = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(buf)
    except ValueError as exc:
        raise ArchiveError(f"{what}: member {info.filename!r} is not an .npy file: {exc}") from exc
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
    else:
        raise ArchiveError(f"{what}: member {info.filename!r} has .npy version {version}; expected 1.0 or 2.0")
    if dtype.hasobject:
        raise ArchiveError(f"{what}: member {info.filename!r} holds Python objects; expected numbers or text")
    offset = buf.tell()
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != len(raw) - offset:
        raise ArchiveError(
            f"{what}: member {info.filename!r} declares shape {shape} of {dtype}, which its bytes do not hold"
        )
    flat = np.frombuffer(raw, dtype=dtype, offset=offset)  # a view of the member's bytes: no second copy
    return flat.reshape(shape, order="F" if fortran else "C")


def load_stored(blob: bytes, *, what: str, max_members: int) -> dict[str, NDArray[Any]]:
    """The named arrays of a stored ``.npz`` archive; anything else is an :class:`ArchiveError`."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            infos = archive.infolist()
            if len(infos) > max_members:
                raise ArchiveError(f"{what}: expected at most {max_members} members, found {len(infos)}")
            names: set[str] = set()
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                    raise ArchiveError(f"{what}: expected stored .npy members, found {info.filename!r}")
                if info.file_size > len(blob) or info.compress_size != info.file_size:
                    raise ArchiveError(f"{what}: member {info.filename!r} declares more bytes than the archive holds")
                names.add(info.filename)
            if len(names) != len(infos):
                raise ArchiveError(f"{what}: expected distinct member names, found a repeated one")
            return {info.filename[: -len(".npy")]: _member(archive, info, what) for info in infos}
    except ArchiveError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, MemoryError, KeyError) as exc:
        raise ArchiveError(f"{what}: expected an .npz archive, found a damaged one ({type(exc).__name__})") from exc
