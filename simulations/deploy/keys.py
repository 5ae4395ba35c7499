"""A SuperNode's authentication key pair, in the form Flower 1.41 loads.

The private key is an unencrypted OpenSSH private key on a NIST elliptic curve
(``flower-supernode --auth-supernode-private-key`` loads it with ``load_ssh_private_key`` and
requires ``ec.EllipticCurvePrivateKey``); the public key is the matching OpenSSH public key line
(``flwr supernode register`` loads it with ``load_ssh_public_key`` and requires a NIST curve).
Flower's documentation uses P-384. The private key is written with mode 0600.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from simulations.deploy.files import DeployFileError, refuse_existing, write_file

NODE_KEY_CURVE = ec.SECP384R1  # what Flower's documentation generates (ssh-keygen -t ecdsa -b 384)


@dataclass(frozen=True)
class NodeKeys:
    """One SuperNode's authentication key pair: OpenSSH private key and ``.pub`` public key."""

    private: Path
    public: Path

    @classmethod
    def at(cls, path: Path) -> NodeKeys:
        return cls(path, path.with_name(path.name + ".pub"))


def make_node_keys(path: Path, *, comment: str = "", force: bool = False) -> NodeKeys:
    """A SuperNode key pair: ``path`` (OpenSSH private key, P-384, mode 0600) and ``path.pub``.

    Start the SuperNode with ``--auth-supernode-private-key path``; register ``path.pub`` on the
    SuperLink with ``flwr supernode register path.pub <connection>``.
    """
    out = NodeKeys.at(path)
    refuse_existing((out.private, out.public), force)
    key = ec.generate_private_key(NODE_KEY_CURVE())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    if comment:
        if any(c.isspace() for c in comment):
            raise DeployFileError(f"comment: expected no whitespace, got {comment!r}")
        public += b" " + comment.encode()
    write_file(out.private, private, private=True)
    write_file(out.public, public + b"\n", private=False)
    return out
