"""Frames from the ClientApp side whose .npy headers numpy's parser chokes on are FrameErrors (review 2).

An unterminated header dict made numpy's header parser raise tokenize.TokenError, which escaped
``local_wire._unpack``: the service's handler raised before it could pace or answer, and the
connection thread died with a traceback (105 of 30,000 mutated frames).
"""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from client_agent import local_wire


def frame_with_npy_header(text: str) -> bytes:
    member = io.BytesIO()
    np.lib.format.write_array(member, np.zeros(2))
    raw = member.getvalue()
    length = int.from_bytes(raw[8:10], "little")
    npy = raw[:10] + text.ljust(length - 1).encode() + b"\n" + raw[10 + length :]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("a.npy", npy)
        archive.writestr(f"{local_wire.HEADER}.npy", npy)
    return out.getvalue()


@pytest.mark.parametrize(
    "header",
    [
        "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), ",  # unterminated: TokenError inside numpy
        "{'descr': '<f8', 'fortran_order': False, 'shape': (2,)} )))",
    ],
)
def test_a_frame_numpy_cannot_parse_is_a_frame_error(header: str) -> None:
    with pytest.raises(local_wire.FrameError, match=r"frame: expected a stored \.npz archive, found: TokenError"):
        local_wire.unpack_request(frame_with_npy_header(header))
