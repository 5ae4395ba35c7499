"""Deployment files: certificates, SuperNode keys in the format flwr 1.41 loads, agent TOMLs, run-config arguments."""

from __future__ import annotations

import json
import re
import socket
import ssl
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key

from client_agent.config import _KEYS, AgentConfigError, parse_agent_config
from simulations.cli import main as cli_main
from simulations.deploy.agent_files import check_agent_file, toml_value, write_agent_toml
from simulations.deploy.certs import connection_toml, make_certificates
from simulations.deploy.files import DeployFileError
from simulations.deploy.keys import make_node_keys
from simulations.deploy.local import run_config_args

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "agent.example.toml"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_example_agent_file_validates_and_documents_every_key() -> None:
    cfg = parse_agent_config({"agent-config": str(EXAMPLE)})
    assert (cfg.epsilon, cfg.delta, cfg.filter, cfg.unit, cfg.trust) == (2.0, 1e-5, "gdp", "record", "local")
    assert cfg.policy.min_noise_std == 1.0 and cfg.policy.max_clip == 10.0
    assert cfg.policy.allowed_trust == ("local",)
    text = EXAMPLE.read_text()
    missing = sorted(
        k for k in _KEYS - {"noise-seed"} if not re.search(rf"^#? ?({re.escape(k)} =|\[{re.escape(k)}\.)", text, re.M)
    )
    assert not missing, f"docs/agent.example.toml: document the keys {missing}"


def test_agent_config_errors_name_expected_and_found(tmp_path: Path) -> None:
    bad = tmp_path / "agent.toml"
    bad.write_text(EXAMPLE.read_text().replace("epsilon = 2.0", 'epsilon = "two"'))
    with pytest.raises(AgentConfigError, match="'epsilon' must be float, got 'two'"):
        parse_agent_config({"agent-config": str(bad)})
    bad.write_text(EXAMPLE.read_text().replace("epsilon = 2.0", "epsilon = 1" + "0" * 400))  # TOML reads any length
    with pytest.raises(AgentConfigError, match="'epsilon': expected a finite number, got an integer of 1329 bits"):
        parse_agent_config({"agent-config": str(bad)})
    with pytest.raises(AgentConfigError, match="agent-config: no file at"):
        parse_agent_config({"agent-config": str(tmp_path / "none.toml")})


POLICY = {"policy-min-noise-std": 0.5, "policy-max-clip": 5.0}  # a deployed agent states both


def test_check_agent_file(tmp_path: Path) -> None:
    x = np.zeros((5, 3), dtype=np.float32)
    np.savez(tmp_path / "data.npz", x=x, y=np.zeros(5, dtype=np.int64))
    good = {"ledger-path": str(tmp_path / "ledger.sqlite"), "data-path": str(tmp_path / "data.npz")}
    path = write_agent_toml(tmp_path / "agent.toml", {**good, "epsilon": 1.0, "delta": 1e-6, **POLICY})
    described = check_agent_file(path)
    assert described["units"] == 5 and described["ledger"] == "created at the first request"
    # What one request can cost at most: min((C / sigma_min)^2, share * T), here (5 / 0.5)^2 = 100 > T / 4.
    from protocol.filters import GaussianFilter

    threshold = GaussianFilter.gdp(epsilon=1.0, delta=1e-6).threshold
    most = described["effective_policy"]["one_request_costs_at_most"]  # type: ignore[index]
    assert most["set_by"] == "policy-max-request-share" and most["share_of_budget"] == pytest.approx(0.25)
    assert most["S"] == pytest.approx(0.25 * threshold) and most["requests_to_spend_a_budget_at_least"] == 4
    assert described["federations"] == [{"name": "default", "quota": 1.0, "monitor": True, "socket": None}]
    assert not (tmp_path / "ledger.sqlite").exists()  # checking creates nothing
    # Relative paths in the file resolve against the file's folder, wherever the SuperNode runs.
    (tmp_path / "sub").mkdir()
    relative = write_agent_toml(
        tmp_path / "sub" / "rel.toml",
        {"ledger-path": "ledger.sqlite", "data-path": "../data.npz", "epsilon": 1.0, "delta": 0.1, **POLICY},
    )
    assert check_agent_file(relative)["records"] == 5
    cfg = parse_agent_config({"agent-config": str(relative)})
    assert cfg.data_path.resolve() == (tmp_path / "data.npz").resolve()
    assert cfg.ledger_path == (tmp_path / "sub").resolve() / "ledger.sqlite"
    gone = write_agent_toml(
        tmp_path / "sub" / "gone.toml",
        {"ledger-path": "l.sqlite", "data-path": "data.npz", "epsilon": 1.0, "delta": 0.1, **POLICY},
    )
    with pytest.raises(DeployFileError, match="found nothing at"):
        check_agent_file(gone)  # resolved against sub/, where there is no data.npz
    missing = write_agent_toml(
        tmp_path / "miss.toml", {**good, "data-path": str(tmp_path / "no.npz"), "epsilon": 1.0, "delta": 0.1, **POLICY}
    )
    with pytest.raises(DeployFileError, match="found nothing at"):
        check_agent_file(missing)


def test_certificates_chain_and_tls_handshake(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path / "certs")
    for key in (certs.ca_key, certs.server_key):
        assert mode(key) == 0o600
    for cert in (certs.ca_cert, certs.server_cert):
        assert mode(cert) == 0o644
    server = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
    ca = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", "::1"}

    # A TLS server with these files, a client that trusts only ca.crt and dials 127.0.0.1.
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(certs.server_cert, certs.server_key)
    client_ctx = ssl.create_default_context(cafile=str(certs.ca_cert))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def serve() -> None:
            conn, _ = listener.accept()
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                assert tls.recv(2) == b"ok"
        thread.join(timeout=10)


def test_certificates_refuse_to_overwrite(tmp_path: Path) -> None:
    first = make_certificates(tmp_path)
    before = first.ca_key.read_bytes()
    with pytest.raises(DeployFileError, match=r"refusing to overwrite existing files .*ca\.crt.*--force"):
        make_certificates(tmp_path)
    assert first.ca_key.read_bytes() == before
    make_certificates(tmp_path, force=True, hosts=["coordinator.example.org", "10.0.0.5"])
    assert first.ca_key.read_bytes() != before and mode(first.ca_key) == 0o600
    with pytest.raises(DeployFileError, match="host: expected an IP address or a DNS name"):
        make_certificates(tmp_path / "other", hosts=["bad host"])


def test_node_keys_load_as_flower_does(tmp_path: Path) -> None:
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    keys = make_node_keys(tmp_path / "agent0", comment="agent0@site")
    assert mode(keys.private) == 0o600 and mode(keys.public) == 0o644
    assert keys.public.read_text().startswith("ecdsa-sha2-nistp384 ")
    private = load_ssh_private_key(keys.private.read_bytes(), None)  # as flower-supernode loads it
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    registered = try_load_public_key(keys.public)  # as `flwr supernode register` loads it
    assert registered == public_key_to_bytes(private.public_key())


def test_node_keys_refuse_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["keys", str(tmp_path / "node")]) == 0
    before = (tmp_path / "node").read_bytes()
    assert cli_main(["keys", str(tmp_path / "node")]) == 2
    assert "refusing to overwrite existing files" in capsys.readouterr().err
    assert (tmp_path / "node").read_bytes() == before
    assert cli_main(["keys", str(tmp_path / "node"), "--force"]) == 0
    assert (tmp_path / "node").read_bytes() != before
    assert cli_main(["certs", "--out", str(tmp_path / "certs")]) == 0
    assert mode(tmp_path / "certs" / "server.key") == 0o600


def test_run_config_arguments_parse_as_flower_parses_them() -> None:
    from flwr.common.config import parse_config_args

    config = {
        "rounds": 3,
        "noise-std": 1e-05,
        "progress": False,
        "run-id": "run-1",
        "model-args": '{"in_features": 4, "n_classes": 2}',
        "output-dir": "/tmp/a b/out",
    }
    args = run_config_args(config)
    assert args[::2] == ["-c"] * len(config)
    assert parse_config_args(args[1::2]) == config


def test_connection_toml_is_what_flwr_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.cli.flower_config import read_superlink_connection

    (tmp_path / "config.toml").write_text(connection_toml("127.0.0.1:9093", tmp_path / "ca.crt"))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    conn = read_superlink_connection(None)
    assert conn.name == "fedfilter-local" and conn.address == "127.0.0.1:9093"
    assert conn.root_certificates == str((tmp_path / "ca.crt").resolve())


def test_agent_check_refuses_the_realisation_filter_over_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """privacy.md §6: records share their client's noise, so the realisation filter needs client units."""
    np.savez(tmp_path / "data.npz", x=np.zeros((5, 3), np.float32), y=np.zeros(5, np.int64))
    fields = {
        "ledger-path": str(tmp_path / "ledger.sqlite"),
        "data-path": str(tmp_path / "data.npz"),
        "epsilon": 5.0,
        "delta": 1e-5,
        "filter": "realisation",
        "realisation-max-rounds": 10,
        "policy-max-clip": 1.0,
        "policy-min-noise-std": 2.0,
    }
    refused = tmp_path / "records.toml"  # written by hand: write_agent_toml itself refuses it
    refused.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in {**fields, "unit": "record"}.items()))
    assert cli_main(["agent", "check", str(refused)]) == 2
    assert "filter: 'realisation' needs unit 'client' (one unit per noise draw), got unit 'record'" in (
        capsys.readouterr().err
    )
    accepted = write_agent_toml(tmp_path / "client.toml", {**fields, "unit": "client"})
    assert cli_main(["agent", "check", str(accepted)]) == 0
    assert json.loads(capsys.readouterr().out)["units"] == 1


def test_agent_files_for_the_realisation_filter_state_no_share_cap(tmp_path: Path) -> None:
    """Its request is capped by mu_max (privacy.md §11): the files leave the share at 1, which the agent accepts."""
    from simulations.deploy.agent_files import write_agent_files

    parts = [(np.zeros((4, 3), np.float32), np.zeros(4, np.int64))]
    agent = {"epsilon": 5.0, "delta": 1e-5, "filter": "realisation", "unit": "client", "realisation-max-rounds": 10}
    (path,) = write_agent_files(tmp_path, parts, **agent)
    config = parse_agent_config({"agent-config": str(path)})
    assert config.policy.max_request_share == 1.0
    assert config.realisation_filter().mu_max == 1.0  # the files' default clip 1 over noise floor 1
