"""The wire contract, the filters and the CLI import light (issue 16): no torch, Flower or cryptography until used."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "flwr", "cryptography", "matplotlib")


def heavy_modules_after(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; the heavy packages it left imported."""
    code += f"\nimport json, sys; print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout.splitlines()[-1]))


def test_protocol_filters_and_messages_load_neither_torch_nor_flower_nor_cryptography() -> None:
    code = (
        "import json, sys\n"
        "import protocol.filters, protocol.messages, protocol.secagg, workloads.registry\n"
        "print(json.dumps(sorted(m for m in ('torch', 'flwr', 'cryptography') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_the_secagg_primitives_still_work_once_used() -> None:
    from protocol import secagg as sa

    identity = sa.new_identity()
    message = b"fedfilter"
    assert sa.signature_valid(sa.identity_public_key(identity), message, sa.sign(identity, message))
    secret, public = sa.generate_keypair()
    assert sa.public_key_of(secret) == public


def test_the_cli_parser_and_the_budget_command_load_neither_torch_nor_flower_nor_cryptography() -> None:
    """``fedfilter budget`` is a calculator: it must start without the federation's heavy packages."""
    assert heavy_modules_after("from simulations.cli import build_parser; build_parser()") == []
    budget = "['budget', '--epsilon', '1', '--delta', '1e-5', '--noise-std', '10', '--clip', '1', '--max-rounds', '5']"
    assert heavy_modules_after(f"from simulations.cli import main; assert main({budget}) == 0") == []


def test_a_commands_parser_loads_neither_torch_nor_flower_nor_cryptography() -> None:
    """Every command's handler imports what it runs; building the parser (and its --help) imports none of it."""
    for argv in (["--help"], ["simulate", "--help"], ["agent", "demo", "--help"], ["reproduce", "fz-mnist", "--help"]):
        code = f"from simulations.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
        assert heavy_modules_after(code) == [], argv
