"""The agent's long-term secagg identity: its Ed25519 signing key and the peers it trusts.

In ``secagg`` trust a coordinator that deviates could invent roster members or substitute a
peer's keys (protocol/secagg.py, "identities and signatures"). Each agent therefore signs its
key advertisements with a long-term key the data owner controls, and accepts a roster only
when every member is signed by an identity in the owner's ``secagg-peers`` file: the
federation's members, agreed outside the coordinator (exchanged by the data owners, or
distributed by a party they trust). The coordinator never supplies that list.

Files (both plain text, written by ``fedfilter agent keygen``):

- ``secagg-identity-key``: one line, the 32-byte secret as 64 hex characters. It must not be
  readable by group or others (mode 0600), as an SSH key.
- ``secagg-peers``: one identity public key per line (64 hex characters), ``#`` starts a
  comment. The agent's own identity may be listed or not.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterable
from pathlib import Path

from client_agent.config import AgentConfigError
from protocol import secagg as sa

HEX_CHARS = 2 * sa.KEY_BYTES


def _hex_key(text: str, *, where: str) -> bytes:
    text = text.strip()
    if len(text) != HEX_CHARS or any(c not in "0123456789abcdefABCDEF" for c in text):
        raise AgentConfigError(f"{where}: expected a key of {HEX_CHARS} hex characters, found {len(text)} characters")
    return bytes.fromhex(text)


def write_identity(path: Path, owner: str | None = None) -> bytes:
    """Create a fresh identity key file at ``path`` (mode 0600, never overwritten); return its public key.

    ``owner`` (an OS user name or uid): the agent's user, who must be able to read it (the file is
    given to that user). ``fedfilter agent keygen`` run as root requires it.
    """
    uid = gid = None
    if owner is not None:
        try:
            entry = pwd.getpwuid(int(owner)) if owner.isdigit() else pwd.getpwnam(owner)
        except KeyError:
            raise AgentConfigError(f"--owner: expected an existing OS user or uid, found {owner!r}") from None
        uid, gid = entry.pw_uid, entry.pw_gid
    secret = sa.new_identity()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AgentConfigError(
            f"secagg-identity-key: a file already exists at {path}; refusing to replace a key"
        ) from None
    except PermissionError:
        raise AgentConfigError(
            f"secagg-identity-key: cannot create {path}: its folder is not writable by this user"
        ) from None
    if uid is not None and gid is not None:
        os.fchown(fd, uid, gid)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return sa.identity_public_key(secret)


def ensure_identity(path: Path) -> bytes:
    """The public key of the identity at ``path``, creating the key file when there is none."""
    if not path.exists():
        return write_identity(path)
    return sa.identity_public_key(load_identity(path))


def load_identity(path: Path) -> bytes:
    """The identity secret in ``path``; refused when group or others can read it, or it is not one hex key."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except FileNotFoundError:
        raise AgentConfigError(f"secagg-identity-key: no file at {path}") from None
    except PermissionError:
        raise AgentConfigError(
            f"secagg-identity-key: {path} exists but this user (uid {os.geteuid()}) cannot read it; it must belong "
            "to the agent's user, mode 0600 (chown AGENT_USER, or write it with `fedfilter agent keygen --owner`)"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AgentConfigError(
            f"secagg-identity-key: {path} is accessible to group or others (mode {stat.S_IMODE(mode):04o}); "
            "expected 0600 (chmod 600)"
        )
    return _hex_key(text, where=f"secagg-identity-key {path}")


def load_peers(path: Path) -> frozenset[bytes]:
    """The trusted identity public keys listed in ``path`` (at least one)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise AgentConfigError(f"secagg-peers: no file at {path}") from None
    keys = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if text:
            keys.append(_hex_key(text, where=f"secagg-peers {path} line {number}"))
    if not keys:
        raise AgentConfigError(f"secagg-peers: expected at least one identity key in {path}, found none")
    return frozenset(keys)


def write_peers(path: Path, identities: Iterable[bytes]) -> Path:
    """Write a ``secagg-peers`` file listing ``identities`` (public keys)."""
    path.write_text(
        "# fedfilter secagg peers: one Ed25519 identity key per line\n" + "".join(k.hex() + "\n" for k in identities)
    )
    return path
