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


class _Reader:
    """A seekable read-only file over a buffer, without copying it (``io.BytesIO`` copies a bytearray)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.view))[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = bytes(self.view[self.pos : end])
        self.pos = end
        return out

    def seekable(self) -> bool:
        return True


_LOCAL_HEADER = 30  # a zip local file header's fixed part; name and extra lengths at offsets 26 and 28
_NPY_HEADER_MAX = 1 << 16


def _member(view: memoryview, info: zipfile.ZipInfo, what: str) -> NDArray[Any]:
    """One stored member as an array *viewing* the archive's bytes: its header checked, nothing copied."""
    start = info.header_offset
    local = bytes(view[start : start + _LOCAL_HEADER])
    if len(local) != _LOCAL_HEADER or local[:4] != b"PK\x03\x04":
        raise ArchiveError(f"{what}: member {info.filename!r} has no local header where the directory says")
    data = start + _LOCAL_HEADER + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
    if data + info.file_size > len(view):
        raise ArchiveError(f"{what}: member {info.filename!r} declares more bytes than the archive holds")
    head = io.BytesIO(bytes(view[data : data + min(info.file_size, _NPY_HEADER_MAX)]))
    try:
        version = np.lib.format.read_magic(head)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
        else:
            raise ArchiveError(f"{what}: member {info.filename!r} has .npy version {version}; expected 1.0 or 2.0")
    except (ValueError, EOFError) as exc:
        raise ArchiveError(f"{what}: member {info.filename!r} is not an .npy file: {exc}") from exc
    if dtype.hasobject:
        raise ArchiveError(f"{what}: member {info.filename!r} holds Python objects; expected numbers or text")
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize != info.file_size - head.tell():
        raise ArchiveError(
            f"{what}: member {info.filename!r} declares shape {shape} of {dtype}, which its bytes do not hold"
        )
    flat = np.frombuffer(view, dtype=dtype, count=count, offset=data + head.tell())
    return flat.reshape(shape, order="F" if fortran else "C")


_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_DIRECTORY_BYTES_PER_MEMBER = 1024  # a central-directory entry: 46 bytes, its name and its zip64 extra


def _check_directory(view: memoryview, what: str, max_members: int) -> None:
    """Refuse an archive whose directory lists too many members *before* ``zipfile`` parses it.

    ``zipfile`` reads the whole central directory first: a frame of a million empty entries would
    cost seconds and hundreds of MB before any count could be checked.
    """
    tail = bytes(view[max(0, len(view) - (1 << 16) - 22) :])
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        raise ArchiveError(f"{what}: expected a zip archive, found no end-of-directory record")
    entries = int.from_bytes(tail[at + 10 : at + 12], "little")
    size = int.from_bytes(tail[at + 12 : at + 16], "little")
    if entries == 0xFFFF or size == 0xFFFFFFFF:  # zip64: the counts live in the zip64 record
        locator = at - 20
        if locator < 0 or tail[locator : locator + 4] != _ZIP64_LOCATOR:
            raise ArchiveError(f"{what}: expected a zip64 locator before the end-of-directory record, found none")
        offset = int.from_bytes(tail[locator + 8 : locator + 16], "little")
        record = bytes(view[offset : offset + 56])
        if len(record) != 56 or record[:4] != _ZIP64_EOCD:
            raise ArchiveError(f"{what}: expected a zip64 end-of-directory record where the locator says")
        entries = int.from_bytes(record[32:40], "little")
        size = int.from_bytes(record[40:48], "little")
    if entries > max_members or size > max_members * _DIRECTORY_BYTES_PER_MEMBER:
        raise ArchiveError(
            f"{what}: expected at most {max_members} members, found a directory of {entries} entries ({size} bytes)"
        )


def load_stored(blob: bytes | bytearray | memoryview, *, what: str, max_members: int) -> dict[str, NDArray[Any]]:
    """The named arrays of a stored ``.npz`` archive, as read-only views of ``blob``; else :class:`ArchiveError`.

    Nothing is copied but the members' small headers: the arrays share ``blob``'s memory, so
    decoding costs at most the archive's own size, however the archive lies.
    """
    view = memoryview(blob).toreadonly().cast("B")
    try:
        _check_directory(view, what, max_members)
        with zipfile.ZipFile(_Reader(view)) as archive:
            infos = archive.infolist()
            if len(infos) > max_members:
                raise ArchiveError(f"{what}: expected at most {max_members} members, found {len(infos)}")
            names: set[str] = set()
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED or not info.filename.endswith(".npy"):
                    raise ArchiveError(f"{what}: expected stored .npy members, found {info.filename!r}")
                if info.file_size > len(view) or info.compress_size != info.file_size:
                    raise ArchiveError(f"{what}: member {info.filename!r} declares more bytes than the archive holds")
                names.add(info.filename)
            if len(names) != len(infos):
                raise ArchiveError(f"{what}: expected distinct member names, found a repeated one")
        return {info.filename[: -len(".npy")]: _member(view, info, what) for info in infos}
    except ArchiveError:
        raise
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, MemoryError, KeyError) as exc:
        raise ArchiveError(f"{what}: expected an .npz archive, found a damaged one ({type(exc).__name__})") from exc
