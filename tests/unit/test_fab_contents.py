"""What `flwr run .` ships: the app bundle (FAB) built from this repository with a deployment work folder inside it.

flwr 1.41 bundles every .py, .toml, .md, .yaml, .yml, .json and .jsonl file under the app folder
that the ROOT ``.gitignore`` does not exclude (nested ``.gitignore`` files are not read), plus its
own few excludes (``.venv/``, ``build/``, ...). The old docs/deploy.md put its work folder
``deploy-demo/`` inside the repository: agent TOMLs, run outputs (summary.json, rounds.jsonl) and the
app bundles Flower unpacks under ``$FLWR_HOME/apps`` would ship with the next run, and the bundle
would grow with every run until it passed flwr's 10 MB limit. The guide now keeps the work folder
outside the app folder; the root ``.gitignore`` is the second guard, tested here.

The bundle is built in-process with the function ``flwr run`` calls (``build_fab_from_disk``), from
a temporary copy of the repository's bundle-eligible files: nothing is written into the repository
and no SuperLink or network is needed.
"""

from __future__ import annotations

import io
import os
import shutil
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("flwr.cli.build")
from flwr.cli.build import build_fab_from_disk
from flwr.common.constant import FAB_INCLUDE_PATTERNS

REPO = Path(__file__).resolve().parents[2]
# Only files with these endings can enter a FAB (FAB_INCLUDE_PATTERNS); copying the others changes nothing.
BUNDLED_SUFFIXES = {".py", ".toml", ".md", ".yaml", ".yml", ".json", ".jsonl"}
# Environments and caches: excluded by flwr itself (.venv) or by the root .gitignore, and large.
SKIPPED_DIRS = {".git", ".venv", ".mypy_cache", ".hypothesis", ".pytest_cache", ".ruff_cache", "__pycache__"}
WORK_FOLDERS = ("deploy-demo", "fedfilter-demo", "fedfilter-out")
MAX_BUNDLE = 2 * 1024 * 1024

# flwr 1.41 builds the bundle through pathspec's deprecated "gitwildmatch" patterns (not our code).
pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")


def test_bundled_suffixes_match_flwr() -> None:
    """The copy below keeps exactly the file kinds flwr may bundle."""
    suffixes = {p.rsplit("*", 1)[1] for p in FAB_INCLUDE_PATTERNS if p.startswith("**/*.")}
    assert suffixes == BUNDLED_SUFFIXES


def copy_app(dest: Path) -> Path:
    """The repository's bundle-eligible files (and its root .gitignore) under ``dest``."""
    for dirpath, dirnames, filenames in os.walk(REPO):
        rel = Path(dirpath).relative_to(REPO)
        dirnames[:] = [
            d
            for d in dirnames
            if d not in SKIPPED_DIRS
            and not d.endswith(".egg-info")
            and not (rel == Path(".") and d in WORK_FOLDERS)  # a leftover one here: each test makes its own
        ]
        for name in filenames:
            source = Path(dirpath) / name
            if source.is_symlink():
                continue
            if Path(name).suffix in BUNDLED_SUFFIXES or (rel == Path(".") and name in (".gitignore", "LICENSE")):
                (dest / rel).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, dest / rel / name)
    return dest


def make_work_folder(app: Path, name: str) -> list[str]:
    """A work folder laid out as the old guide left it after one run; returns its files (relative to ``app``)."""
    work = app / name
    unpacked = "fedfilter.fedfilter.0.1.0.c9ba8ed6"
    files = {
        "agents/agent0.toml": 'data-path = "data0.npz"\nledger-path = "ledgers/client0.sqlite"\n',
        "flwr/config.toml": '[superlink]\ndefault = "fedfilter-local"\n',
        "runs/demo-1/summary.json": '{"run_id": "demo-1"}\n',
        "runs/demo-1/rounds.jsonl": '{"round": 1}\n' * 50,
        "out/demo-2/summary.json": '{"run_id": "demo-2"}\n',  # an output-dir not named runs/
        "notes.md": "# my notes\n",
    }
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    # The bundles Flower unpacked for the SuperLink and each SuperNode: a full copy of the app's code each.
    for home in ("flwr", "node0", "node1", "node2"):
        for package in ("client_agent", "coordinator", "protocol", "workloads"):
            shutil.copytree(
                app / package,
                work / home / "apps" / unpacked / package,
                ignore=shutil.ignore_patterns("__pycache__"),
            )
        (work / home / "apps" / unpacked / "pyproject.toml").write_text((app / "pyproject.toml").read_text())
    return sorted(p.relative_to(app).as_posix() for p in work.rglob("*") if p.is_file())


def bundle_names(app: Path) -> tuple[list[str], int]:
    fab = build_fab_from_disk(app)
    return zipfile.ZipFile(io.BytesIO(fab)).namelist(), len(fab)


def test_root_gitignore_names_the_work_folders() -> None:
    patterns = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
    missing = [f"{name}/" for name in WORK_FOLDERS if f"{name}/" not in patterns]
    assert not missing, f".gitignore: add {missing} (flwr run . would bundle a work folder's .toml/.json files)"


@pytest.mark.parametrize("work", WORK_FOLDERS)
def test_work_folder_inside_the_app_is_not_bundled(tmp_path: Path, work: str) -> None:
    app = copy_app(tmp_path / "fedfilter")
    work_files = make_work_folder(app, work)
    assert any(f.endswith(".py") for f in work_files) and any(f.endswith(".json") for f in work_files)
    names, size = bundle_names(app)
    leaked = sorted(n for n in names if n.split("/", 1)[0] == work)
    assert not leaked, f"the bundle ships work-folder files: {leaked[:10]}"
    assert size < MAX_BUNDLE, f"bundle is {size} bytes"
    # It is still the app: the ServerApp, the ClientApp proxy and the packages they import.
    for needed in ("coordinator/server_app.py", "client_agent/client_app.py", "protocol/messages.py"):
        assert needed in names


def without_fab_include(app: Path) -> None:
    """The app's pyproject.toml without its ``fab-include`` list (flwr then bundles every eligible file)."""
    text = (app / "pyproject.toml").read_text()
    start = text.index("fab-include = [")
    end = text.index("]", start) + 1
    (app / "pyproject.toml").write_text(text[:start] + text[end:])


def test_without_the_gitignore_guard_the_work_folder_ships(tmp_path: Path) -> None:
    """The control: flwr's own excludes do not cover a work folder; ``fab-include`` (the first guard,
    removed here) and the root .gitignore (the second) do."""
    app = copy_app(tmp_path / "fedfilter")
    without_fab_include(app)
    gitignore = app / ".gitignore"
    gitignore.write_text(
        "".join(line + "\n" for line in gitignore.read_text().splitlines() if line.strip() != "deploy-demo/")
    )
    names_before, size_before = bundle_names(app)
    make_work_folder(app, "deploy-demo")
    names, size = bundle_names(app)
    leaked = [n for n in names if n.startswith("deploy-demo/")]
    assert "deploy-demo/out/demo-2/summary.json" in leaked  # (runs/ is ignored at any depth already)
    assert "deploy-demo/agents/agent0.toml" in leaked
    assert any(n.startswith("deploy-demo/node0/apps/") and n.endswith(".py") for n in leaked)
    # Every file of the four unpacked copies ships (a real unpacked bundle is the whole app, ~5x per run). Counted,
    # not weighed against the whole app: a ratio to the app's size fell as the results file grew with the campaign.
    packages = ("client_agent", "coordinator", "protocol", "workloads")
    per_copy = sum(1 for pkg in packages for f in (app / pkg).rglob("*.py") if "__pycache__" not in f.parts)
    copies = [n for n in leaked if "/apps/" in n and n.endswith(".py")]
    assert per_copy > 50 and len(copies) == 4 * per_copy
    assert size > size_before and len(names) == len(names_before) + len(leaked)


def test_the_bundle_holds_only_the_apps_modules(tmp_path: Path) -> None:
    """``fab-include`` in pyproject.toml: the ServerApp's packages and the ClientApp proxy, nothing else.

    No simulations/, tests/, benchmarks/ or docs/, and none of the agent's own code: the agent is the
    owner's service, and a bundle that carried it would only invite running it under the SuperNode.
    """
    import tomllib

    names, size = bundle_names(copy_app(tmp_path / "fedfilter"))
    tops = {n.split("/", 1)[0] for n in names if not n.startswith(".info/")}
    assert tops == {"pyproject.toml", "protocol", "workloads", "coordinator", "client_agent"}
    agent_files = sorted(n for n in names if n.startswith("client_agent/"))
    assert agent_files == ["client_agent/__init__.py", "client_agent/client_app.py", "client_agent/local_wire.py"]
    # Everything the two apps import is in it (the ServerApp loads the workload registry at run time).
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["components"]
    for ref in config.values():
        assert ref.split(":")[0].replace(".", "/") + ".py" in names
    for package in ("protocol", "workloads", "coordinator"):
        expected = {p.relative_to(REPO).as_posix() for p in (REPO / package).rglob("*.py")}
        assert expected <= set(names), sorted(expected - set(names))
    assert size < 512 * 1024, f"bundle is {size} bytes"
