"""The SuperLink's TLS files and Flower's connection config (SuperNode keys: :mod:`simulations.deploy.keys`).

What Flower 1.41 expects (read from the installed ``flwr``):
- SuperLink TLS: ``--ssl-ca-certfile``, ``--ssl-certfile``, ``--ssl-keyfile``, PEM files
  (``flwr.common.args.try_obtain_server_certificates``); SuperNodes and ``flwr`` verify the
  server against the CA given as ``--root-certificates`` / ``root-certificates``. The server
  certificate must name the address clients dial (here 127.0.0.1 and localhost by default).
- ``flwr run`` and ``flwr supernode register`` find the SuperLink through the connection table
  ``[superlink.<name>]`` of ``$FLWR_HOME/config.toml`` (default ``~/.flwr``).

Private keys are written with mode 0600 and never overwrite an existing file unless ``force``.
"""

from __future__ import annotations

import datetime
import ipaddress
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from simulations.deploy.files import DeployFileError, refuse_existing, write_file

DEFAULT_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")
TLS_KEY_CURVE = ec.SECP384R1
CONNECTION = "fedfilter-local"


@dataclass(frozen=True)
class Certificates:
    """The SuperLink's TLS files: the CA (and its key) and the server certificate and key."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def in_dir(cls, folder: Path) -> Certificates:
        return cls(folder / "ca.crt", folder / "ca.key", folder / "server.pem", folder / "server.key")

    def files(self) -> tuple[Path, ...]:
        return (self.ca_cert, self.ca_key, self.server_cert, self.server_key)


def _pem_private(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not host or any(c.isspace() for c in host):
                raise DeployFileError(f"host: expected an IP address or a DNS name, got {host!r}") from None
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_certificates(
    folder: Path, *, hosts: Sequence[str] = DEFAULT_HOSTS, days: int = 365, force: bool = False
) -> Certificates:
    """A new CA and a server certificate it signs, valid for ``hosts`` (IP addresses or DNS names).

    The SuperLink takes ``ca.crt``, ``server.pem`` and ``server.key``; SuperNodes and ``flwr``
    take ``ca.crt``. ``ca.key`` signs further server certificates; keep it offline.
    """
    if days < 1:
        raise DeployFileError(f"days: expected an integer >= 1, got {days}")
    if not hosts:
        raise DeployFileError("hosts: expected at least one IP address or DNS name the SuperLink is reached at")
    out = Certificates.in_dir(folder)
    refuse_existing(out.files(), force)
    san = _san(hosts)
    now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)

    ca_key = ec.generate_private_key(TLS_KEY_CURVE())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedfilter coordinator CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=max(days, 3650)))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA384())
    )

    server_key = ec.generate_private_key(TLS_KEY_CURVE())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0]))]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(san, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA384())
    )

    write_file(out.ca_key, _pem_private(ca_key), private=True)
    write_file(out.server_key, _pem_private(server_key), private=True)
    write_file(out.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    write_file(out.server_cert, server_cert.public_bytes(serialization.Encoding.PEM), private=False)
    return out


def connection_toml(address: str, root_certificates: Path, *, name: str = CONNECTION) -> str:
    """The ``$FLWR_HOME/config.toml`` that makes ``name`` the default connection to a TLS SuperLink."""
    return (
        f'[superlink]\ndefault = "{name}"\n\n'
        f"[superlink.{name}]\n"
        f'address = "{address}"\n'
        f'root-certificates = "{root_certificates.resolve()}"\n'
    )


def write_connection(flwr_home: Path, address: str, root_certificates: Path, *, name: str = CONNECTION) -> Path:
    """Write (or replace) ``flwr_home/config.toml`` with one connection; returns its path."""
    text = connection_toml(address, root_certificates, name=name)
    tomllib.loads(text)  # what flwr will parse
    flwr_home.mkdir(parents=True, exist_ok=True)
    path = flwr_home / "config.toml"
    path.write_text(text)
    return path
