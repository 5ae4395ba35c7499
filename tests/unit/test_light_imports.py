"""The wire contract and the filters import light (issue 16): no torch, Flower or cryptography until used."""

from __future__ import annotations

import json
import subprocess
import sys


def test_protocol_filters_and_messages_load_neither_torch_nor_flower_nor_cryptography() -> None:
    code = (
        "import json, sys\n"
        "import protocol.filters, protocol.messages, protocol.secagg, protocol.workload\n"
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
