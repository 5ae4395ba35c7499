"""The agent's secagg identity: its key file, its trusted peers, and the configuration that requires them."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import numpy as np
import pytest

from client_agent.config import AgentConfigError, parse_agent_config
from client_agent.identity import load_identity, load_peers, write_identity, write_peers
from protocol import secagg as sa
from simulations.cli import main as cli_main
from simulations.deploy.agent_files import check_agent_file, write_agent_toml
from tests.factories import node_config


def base(tmp_path: Path) -> dict[str, object]:
    # A deployed agent's configuration: its noise floor and clip limit are stated.
    data = (np.zeros((4, 3), np.float32), np.zeros(4, np.int64))
    policy = {"policy-min-noise-std": 0.1, "policy-max-clip": 10.0}
    return node_config(tmp_path, data, unit="client", trust="secagg", **policy)


def test_secagg_trust_requires_the_identity_and_the_peers(tmp_path: Path) -> None:
    with pytest.raises(AgentConfigError, match=r"secagg-identity-key and secagg-peers: expected both .* found neither"):
        parse_agent_config(base(tmp_path))
    with pytest.raises(AgentConfigError, match="found one"):
        parse_agent_config(base(tmp_path) | {"secagg-peers": str(tmp_path / "peers.txt")})
    assert parse_agent_config(base(tmp_path) | {"trust": "local"}).secagg_identity_key is None  # other trusts: none


def test_keygen_writes_a_private_key_once_and_prints_its_identity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "identity.key"
    owner = [] if os.geteuid() != 0 else ["--owner", "root"]  # as root the agent's user must be named
    assert cli_main(["agent", "keygen", str(key), *owner]) == 0
    printed = capsys.readouterr().out
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    public = sa.identity_public_key(load_identity(key))
    assert public.hex() in printed
    before = key.read_bytes()
    with pytest.raises(AgentConfigError, match=r"a file already exists .* refusing to replace a key"):
        write_identity(key)
    assert key.read_bytes() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="the root case: as another user keygen writes the user's own key")
def test_keygen_as_root_names_the_agents_user_or_says_what_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "identity.key"
    assert cli_main(["agent", "keygen", str(key)]) != 0
    assert f"run `fedfilter agent keygen {key} --owner AGENT_USER`" in capsys.readouterr().err
    assert not key.exists()
    assert cli_main(["agent", "keygen", str(key), "--owner", "nobody"]) == 0
    st = key.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (pwd.getpwnam("nobody").pw_uid, 0o600)


def test_a_key_readable_by_others_or_malformed_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "identity.key"
    write_identity(key)
    os.chmod(key, 0o644)
    with pytest.raises(AgentConfigError, match="accessible to group or others \\(mode 0644\\); expected 0600"):
        load_identity(key)
    bad = tmp_path / "bad.key"
    bad.write_text("abc\n")
    os.chmod(bad, 0o600)
    with pytest.raises(AgentConfigError, match="expected a key of 64 hex characters, found 3 characters"):
        load_identity(bad)
    with pytest.raises(AgentConfigError, match="no file at"):
        load_identity(tmp_path / "missing.key")


def test_the_peers_file_names_the_line_it_cannot_read(tmp_path: Path) -> None:
    keys = [sa.identity_public_key(sa.new_identity()) for _ in range(2)]
    peers = write_peers(tmp_path / "peers.txt", keys)
    peers.write_text(peers.read_text() + "   # a comment line\n\n")
    assert load_peers(peers) == frozenset(keys)
    peers.write_text(keys[0].hex() + "\nnot-a-key\n")
    with pytest.raises(AgentConfigError, match="line 2: expected a key of 64 hex characters"):
        load_peers(peers)
    peers.write_text("# nobody\n")
    with pytest.raises(AgentConfigError, match="expected at least one identity key"):
        load_peers(peers)


def test_agent_check_reports_the_identity_and_refuses_a_bad_key(tmp_path: Path) -> None:
    key = tmp_path / "identity.key"
    public = write_identity(key)
    write_peers(tmp_path / "peers.txt", [public])
    toml = write_agent_toml(
        tmp_path / "agent.toml", base(tmp_path) | {"secagg-identity-key": "identity.key", "secagg-peers": "peers.txt"}
    )
    described = check_agent_file(toml)  # relative paths resolve against the file's folder
    assert described["secagg-identity"] == public.hex() and described["secagg-peers"] == 1
    os.chmod(key, 0o640)
    with pytest.raises(AgentConfigError, match="accessible to group or others"):
        check_agent_file(toml)
