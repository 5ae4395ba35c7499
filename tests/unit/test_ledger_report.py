"""``fedfilter ledger requests``, ``ledger show --units`` and ``ledger report`` on a ledger the real agent wrote.

One agent serves two federations (quotas 0.6 each) on one ledger: federation ``alpha`` trains (run
``train``), federation ``beta`` asks counting queries (run ``count``) and one gradient under a run id
meant to break a terminal, an HTML page or matplotlib's mathtext. The commands are checked against
the agent's own state and the stored releases.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from client_agent.ledger import Ledger
from client_agent.ledger_report import odometer_of
from client_agent.state import AgentState
from protocol import messages as wire
from simulations.cli import main
from tests.factories import build_agent, gradient_request, indicator_request

HOSTILE_RUN = "evil$\\frac{<b>\n\x1b[31m"


@dataclass(frozen=True)
class Built:
    path: Path
    spent: np.ndarray
    stopped: np.ndarray
    quotas: dict[str, dict[str, np.ndarray]]
    rows: list[dict[str, object]]
    releases: list[dict[str, np.ndarray]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    folder = tmp_path_factory.mktemp("ledger-report")
    agent = build_agent(
        folder,
        epsilon=2.0,
        **{"noise-seed": 3, "federations": {"alpha": {"quota": 0.6}, "beta": {"quota": 0.6}}},
    )
    rng = np.random.default_rng(0)

    def ask(federation: str, request: Any) -> None:
        outcome = agent.handle(wire.message_type_of(request), *wire.encode_request(request), federation=federation)
        assert outcome.error_code == 0, outcome

    for rnd in range(1, 7):
        params = rng.normal(scale=0.5, size=8).astype(np.float32)
        ask(
            "alpha",
            gradient_request(f"train:gradient:r{rnd}", run_id="train", round=rnd, noise_std=6.0, parameters=params),
        )
        if rnd % 2 == 0:
            ask(
                "beta", indicator_request(f"count:indicator:r{rnd // 2}", run_id="count", round=rnd // 2, noise_std=4.0)
            )
    ask("beta", gradient_request("odd-id", run_id=HOSTILE_RUN, round=1, noise_std=3.0))
    state = AgentState.from_arrays(agent.ledger.state())
    quotas = {name: agent.ledger.quota_state(name) for name in ("alpha", "beta")}
    rows, releases = zip(*agent.ledger.log(), strict=True)
    agent.close()
    assert state.spent is not None and state.stopped is not None
    yield Built(
        folder / "ledger.sqlite",
        state.spent,
        state.stopped,
        {k: v for k, v in quotas.items() if v is not None},
        list(rows),
        list(releases),
    )


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_requests_json_lists_every_answered_request_with_its_cost(
    built: Built, capsys: pytest.CaptureFixture[str]
) -> None:
    entries = json.loads(run_cli(capsys, "ledger", "requests", str(built.path), "--json"))
    assert [e["seq"] for e in entries] == [r["seq"] for r in built.rows]
    assert [e["federation"] for e in entries] == [r["federation"] for r in built.rows]
    alpha = [e for e in entries if e["federation"] == "alpha"]
    assert [e["request_id"] for e in alpha] == [f"train:gradient:r{i}" for i in range(1, 7)]  # no "|alpha|"
    assert [e["round"] for e in alpha] == list(range(1, 7))  # from the coordinator's id
    assert {e["kind"] for e in alpha} == {wire.GRADIENT} and {e["noise_std"] for e in alpha} == {6.0}
    with Ledger.open_existing(built.path) as ledger:
        threshold = float(dict(ledger.config.params["filter"])["threshold"])  # type: ignore[call-overload]
    total = np.zeros_like(built.spent)
    for entry, row, release in zip(entries, built.rows, built.releases, strict=True):
        cost = (release["l2_norms"] / release["noise_std"][0]) ** 2
        total += cost
        assert entry["units_charged"] == int(np.count_nonzero(release["l2_norms"]))
        assert entry["cost_max"] == pytest.approx(cost.max(), rel=1e-12)
        assert entry["cost_mean"] == pytest.approx(cost.mean(), rel=1e-12)
        assert entry["cost_max_share"] == pytest.approx(cost.max() / threshold, rel=1e-12)
        assert entry["reply_bytes"] == row["reply_bytes"] > 0
        assert entry["time"] == row["created_at"]
    np.testing.assert_allclose(total, built.spent, rtol=1e-12)  # the requests' costs add up to the agent's spend
    assert sum(e["units_newly_stopped"] for e in entries) == int(built.stopped.sum())
    assert entries[-1]["run_id"] == HOSTILE_RUN and entries[-1]["round"] is None


def test_requests_text_is_one_line_per_request_with_senders_strings_escaped(
    built: Built, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = run_cli(capsys, "ledger", "requests", str(built.path)).splitlines()
    assert len(lines) == 1 + len(built.rows)
    assert lines[0].split()[:3] == ["time", "(UTC)", "federation"]
    assert "train:gradient:r3" in lines[4] and "alpha" in lines[4]  # r1, r2, the first count, r3
    assert "\x1b" not in lines[-1] and "\\x1b[31m" in lines[-1] and "\\n" in lines[-1]


def test_requests_filter_by_federation_and_since(built: Built, capsys: pytest.CaptureFixture[str]) -> None:
    beta = json.loads(run_cli(capsys, "ledger", "requests", str(built.path), "--json", "--federation", "beta"))
    assert [e["seq"] for e in beta] == [r["seq"] for r in built.rows if r["federation"] == "beta"]
    middle = built.rows[4]
    since = json.loads(
        run_cli(capsys, "ledger", "requests", str(built.path), "--json", "--since", str(middle["created_at"]))
    )
    assert [e["seq"] for e in since] == [r["seq"] for r in built.rows[4:]]
    # Filtering keeps each request's own figures (the replay runs over the whole ledger either way).
    everything = json.loads(run_cli(capsys, "ledger", "requests", str(built.path), "--json"))
    assert since == everything[4:]
    naive = str(middle["created_at"])[:26]  # the same moment with no zone is read as UTC
    assert json.loads(run_cli(capsys, "ledger", "requests", str(built.path), "--json", "--since", naive)) == since
    assert json.loads(run_cli(capsys, "ledger", "requests", str(built.path), "--json", "--since", "2999-01-01")) == []
    assert "no answered request matches" in run_cli(
        capsys, "ledger", "requests", str(built.path), "--since", "2999-01-01"
    )
    assert main(["ledger", "requests", str(built.path), "--since", "yesterday"]) == 2
    assert "--since: expected an ISO date" in capsys.readouterr().err


def test_show_units_gives_each_units_spend_stop_and_odometer_reading(
    built: Built, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = json.loads(run_cli(capsys, "ledger", "show", str(built.path), "--json", "--units"))
    threshold = shown["threshold"]
    units = shown["units"]
    assert [u["unit"] for u in units] == list(range(built.spent.size))
    np.testing.assert_array_equal([u["spent"] for u in units], built.spent)
    np.testing.assert_allclose([u["share"] for u in units], built.spent / threshold, rtol=1e-15)
    np.testing.assert_array_equal([u["stopped"] for u in units], built.stopped)
    with Ledger.open_existing(built.path) as ledger:
        odometer = odometer_of(ledger)
    assert odometer is not None
    eps = np.array([u["epsilon_so_far"] for u in units])
    np.testing.assert_array_equal(eps, odometer.epsilon(built.spent))
    assert all(e >= odometer.plain(s) - 1e-12 for e, s in zip(eps, built.spent, strict=True))
    assert np.all(eps <= shown["odometer"]["epsilon_at_full_budget"])
    assert shown["odometer"]["epsilon_at_full_budget"] > shown["epsilon"]
    # Per federation: its quota state's spend, and the units stopped for it (its own stops and the global ones).
    feds = {f["federation"]: f for f in shown["federations"]}
    assert set(feds) == {"alpha", "beta"}
    assert feds["alpha"]["requests"] == 6 and feds["beta"]["requests"] == 4
    for name, fed in feds.items():
        quota = built.quotas[name]
        assert fed["source"] == "quota_state"
        assert fed["share_max"] == pytest.approx(quota["spent"].max() / threshold, rel=1e-15)
        assert fed["share_mean"] == pytest.approx(quota["spent"].mean() / threshold, rel=1e-15)
        assert fed["units_stopped"] == int(np.count_nonzero(quota["stopped"] | built.stopped))
        assert fed["share_max"] <= 0.6 * (1 + 1e-12)  # within its quota
    np.testing.assert_allclose(built.quotas["alpha"]["spent"] + built.quotas["beta"]["spent"], built.spent)
    # Without --units: the same summary, no per-unit list; the text form names both federations.
    assert "units" not in json.loads(run_cli(capsys, "ledger", "show", str(built.path), "--json"))
    text = run_cli(capsys, "ledger", "show", str(built.path), "--units")
    assert "alpha: 6 requests" in text and "beta: 4 requests" in text and "eps so far" in text


def test_report_writes_figures_and_one_self_contained_page(
    built: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    printed = run_cli(capsys, "ledger", "report", str(built.path), "--out", str(out)).split()
    names = ["spend_share.png", "epsilon.png", "units_stopped.png", "spend_by_federation.png", "report.html"]
    assert printed == [str(out / name) for name in names]
    page = (out / "report.html").read_text(encoding="utf-8")
    for name in names[:-1]:
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
        assert f"data:image/png;base64,{base64.b64encode(png).decode('ascii')}" in page
    # Nothing outside the embedded figures reaches out or runs: the check reads the page with their
    # base64 payloads cut out (a payload may hold "http" or "href" by chance: the figures carry times).
    markup = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]*", "data:image/png;base64,", page)
    assert markup.count("data:image/png;base64,") == len(names) - 1
    assert "http" not in markup and "<script" not in markup and "href" not in markup
    assert "<b>" not in page and "evil$\\frac{&lt;b&gt;\\n\\x1b[31m" in page  # the sender's run id, escaped
    assert "train:gradient:r6" in page and "alpha" in page and "beta" in page
