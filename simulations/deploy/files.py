"""Writing a deployment's files: private ones with mode 0600, none overwritten unless asked (``force``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from protocol.errors import FedfilterError


class DeployFileError(FedfilterError, ValueError):
    """A deployment file exists where a new one would go, or cannot be used."""


def refuse_existing(paths: Sequence[Path], force: bool) -> None:
    """A :class:`DeployFileError` naming the ``paths`` that exist, unless ``force``."""
    existing = [str(p) for p in paths if p.exists() or p.is_symlink()]
    if existing and not force:
        raise DeployFileError(f"refusing to overwrite existing files {existing}; pass --force to replace them")


def write_file(path: Path, data: bytes, *, private: bool) -> None:
    """Write ``data`` to ``path`` through a new file of mode 0600 (private) or 0644, then rename over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600 if private else 0o644)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
