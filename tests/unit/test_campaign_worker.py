"""scripts/campaign_worker.sh: the CPU campaign's worker loop, against a stand-in for the campaign's CLI.

The script runs in a copy of itself inside a throwaway git repository (it works from its own checkout), with
``PY`` a shell script that records how it was called and exits with the codes the test gives it in turn:
what each exit code of ``fedfilter reproduce fz-mnist --campaign --once`` makes the loop do, and which options
reach the CLI. With this interpreter and a committed ``simulations/cli.py`` of the repository's own, which code
a job imports: the commit's snapshot, never the checkout's uncommitted edit (``python -m`` puts the working
directory first on sys.path; the worker runs ``-P``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "campaign_worker.sh"

FAKE = """#!/usr/bin/env bash
# Record the call (the interpreter's options, the CLI's arguments, the commit and source it was given, what
# that source holds), then exit with the next code of codes.txt.
here=$(dirname "$0")
opts=""
while [ "$1" = -P ] || [ "$1" = -c ]; do
  if [ "$1" = -c ]; then opts="$opts -c"; shift 2; else opts="$opts $1"; shift; fi
done
{ echo "ARGS $*"; echo "OPTS$opts"; echo "COMMIT $FEDFILTER_COMMIT"; echo "THREADS $OMP_NUM_THREADS"
  echo "FILES $(cd "$PYTHONPATH" && ls | tr '\\n' ' ')"; } >> "$here/calls.txt"
n=$(wc -l < "$here/used.txt" 2>/dev/null || echo 0)
code=$(sed -n "$((n + 1))p" "$here/codes.txt")
echo "$code" >> "$here/used.txt"
exit "${code:-3}"
"""


def _repo(tmp_path: Path, codes: list[int]) -> tuple[Path, Path]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "campaign_worker.sh")
    (repo / "committed.py").write_text("x = 1\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    (repo / "uncommitted.py").write_text("x = 2\n")  # never in a job's source
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(FAKE)
    fake.chmod(0o755)
    (fake.parent / "codes.txt").write_text("".join(f"{c}\n" for c in codes))
    return repo, fake


def _run(repo: Path, fake: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {"PATH": os.environ["PATH"], "HOME": str(repo), "PY": str(fake), "WAIT_S": "0", **env}
    return subprocess.run(
        ["bash", str(repo / "scripts" / "campaign_worker.sh"), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _calls(fake: Path) -> list[dict[str, str]]:
    path = fake.parent / "calls.txt"
    if not path.exists():
        return []
    calls: list[dict[str, str]] = []
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "ARGS":
            calls.append({})
        calls[-1][key] = value
    return calls


def test_the_worker_goes_on_after_a_job_waits_while_all_are_held_and_stops_when_all_are_done(tmp_path: Path) -> None:
    repo, fake = _repo(tmp_path, [0, 5, 0, 3])
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    done = _run(repo, fake, "w1", ONLY="^trial/tuned/", DATA_DIR="/data/here")
    assert done.returncode == 0, done.stderr
    assert "every job it may take is done" in done.stdout
    calls = _calls(fake)
    assert len(calls) == 4  # a job, all held (waited), a job, nothing left
    for call in calls:
        assert call["COMMIT"] == head.strip()
        assert call["THREADS"] == "1"
        # The job's code is the commit's snapshot: the committed file, not the uncommitted one.
        assert call["FILES"].split() == ["committed.py", "scripts"]
        args = call["ARGS"].split()
        assert call["OPTS"].split() == ["-P", "-c"]  # no checkout on sys.path; the bootstrap runs the CLI
        assert args[:4] == ["reproduce", "fz-mnist", "--campaign", "--once"]
        assert args[args.index("--only") + 1] == "^trial/tuned/"
        assert args[args.index("--data-dir") + 1] == "/data/here"
        assert args[args.index("--threads") + 1] == "1"
        assert args[args.index("--results") + 1] == str(repo / "docs" / "results" / "fz_sec51.jsonl")
        assert "--commit" in args
    assert (repo / "fedfilter-out" / "src-w1" / "committed.py").exists()


@pytest.mark.parametrize("code", [2, 4])
def test_the_worker_stops_with_the_clis_code_when_a_job_failed_twice_or_the_call_was_wrong(
    tmp_path: Path, code: int
) -> None:
    repo, fake = _repo(tmp_path, [0, code, 0])
    done = _run(repo, fake, "w2")
    assert done.returncode == code
    assert f"exited {code}: stopping" in done.stdout
    assert len(_calls(fake)) == 2
    assert "--only" not in _calls(fake)[0]["ARGS"].split()  # no ONLY: every job


def test_the_hold_file_stops_the_worker_before_its_next_job(tmp_path: Path) -> None:
    repo, fake = _repo(tmp_path, [0])
    (repo / "fedfilter-out").mkdir()
    (repo / "fedfilter-out" / "campaign.hold").touch()
    done = _run(repo, fake, "w3")
    assert done.returncode == 0 and "campaign.hold: stopping" in done.stdout
    assert _calls(fake) == []


@pytest.mark.parametrize("name", ["", "../x", "a b"])
def test_a_worker_name_that_is_not_a_plain_name_is_refused(tmp_path: Path, name: str) -> None:
    repo, fake = _repo(tmp_path, [0])
    done = _run(repo, fake, name)
    assert done.returncode != 0
    assert "W" in done.stderr
    assert _calls(fake) == []


def test_a_worker_gives_up_after_max_waits_in_a_row_and_a_landed_job_resets_the_count(tmp_path: Path) -> None:
    repo, fake = _repo(tmp_path, [5, 5, 0, 5, 5, 5])
    done = _run(repo, fake, "w4", MAX_WAITS="2")
    assert done.returncode == 5
    assert "no job to take after 2 waits: stopping" in done.stdout
    assert len(_calls(fake)) == 6  # two waits, a job, two waits, and the third 5 that ends it


CLI = """import os, sys
try:  # in the checkout's editable install, not in the snapshot: a job must not find it
    import client_agent
    found = client_agent.__file__
except ModuleNotFoundError:
    found = "none"
with open(os.environ["RAN_FILE"], "a") as fh:
    fh.write(f"{__file__} {MARK} {found} {sys.argv[1:4]!r}\\n".replace(" ", "|", 3))
sys.exit(3)
"""


def test_a_job_imports_the_commits_snapshot_not_the_checkouts_uncommitted_edit(tmp_path: Path) -> None:
    repo, _ = _repo(tmp_path, [])
    (repo / "simulations").mkdir()
    (repo / "simulations" / "__init__.py").write_text("")
    (repo / "simulations" / "cli.py").write_text(CLI.replace("MARK", "'committed'"))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "cli"], check=True)
    (repo / "simulations" / "cli.py").write_text(CLI.replace("MARK", "'UNCOMMITTED'"))  # an edit, not committed
    ran = tmp_path / "ran.txt"
    done = _run(repo, Path(sys.executable), "w5", RAN_FILE=str(ran))
    assert done.returncode == 0, done.stdout + done.stderr
    file, mark, found, args = ran.read_text().strip().split("|")
    assert (file, mark) == (str(repo / "fedfilter-out" / "src-w5" / "simulations" / "cli.py"), "committed")
    assert found == "none"  # the editable install's finder would have found the checkout's client_agent
    assert args == "['reproduce', 'fz-mnist', '--campaign']"  # the CLI sees its arguments as under -m


@pytest.mark.parametrize("var", ["THREADS", "WAIT_S", "MAX_WAITS"])
def test_a_count_that_is_not_a_whole_number_is_refused_by_name(tmp_path: Path, var: str) -> None:
    repo, fake = _repo(tmp_path, [0])
    done = _run(repo, fake, "w6", **{var: "4x"})
    assert done.returncode == 2 and f"{var}: expected a whole number, got '4x'" in done.stderr
    assert _calls(fake) == []
