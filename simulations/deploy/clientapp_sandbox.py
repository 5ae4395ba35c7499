"""Run each ClientApp so that nothing it does outlives its run (docs/deploy.md §9, issue 25).

Flower's SuperNode starts every run's ClientApp as ``flwr-clientapp ...`` found on its PATH, as the
SuperNode's own user, with the SuperNode's ``FLWR_HOME``. The ClientApp's code comes from the run's
app bundle, which the coordinator ships; a hostile bundle could then

- plant code: Flower unpacks a bundle into ``FLWR_HOME/apps/<name>.<hash>`` and reuses that folder,
  unchecked, for every later run of the same bundle (lines appended to the genuine proxy ran in the
  next genuine runs), and Python runs any ``.pth`` file in the user's site folder at every start;
- leave a process: a daemon forked by the bundle outlived its run and its SuperNode, querying the
  agent every 10 s.

This file, installed as ``flwr-clientapp`` first on the SuperNode's PATH (``fedfilter node-shim DIR``
writes it; it imports the standard library only, so it runs from any interpreter that has Flower),
starts the real ``flwr-clientapp`` instead:

- with a fresh, private ``FLWR_HOME``, ``HOME``, ``TMPDIR`` and working folder per run, removed when
  the run ends: every run unpacks its bundle afresh from the bytes the SuperLink sent, whose hashes
  Flower checks, so no earlier run's writes are ever loaded; Python runs isolated (``-I``: no user
  site folder, no ``PYTHON*`` variables);
- as PID 1 of a new PID namespace (``unshare --user --map-current-user --pid --fork --kill-child``,
  unprivileged): when it exits, or this wrapper dies, the kernel kills every process it left, so no
  process started by a ClientApp outlives its run. Processes in it cannot trace the SuperNode.

Where user namespaces are off (``sysctl user.max_user_namespaces=0``), it refuses to start the
ClientApp (exit 78) and says so, unless ``FEDFILTER_CLIENTAPP_ISOLATION=none`` is set: then only the
fresh folders protect the next run, and the operator must contain processes otherwise (docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ISOLATION_ENV = "FEDFILTER_CLIENTAPP_ISOLATION"
# After SIGTERM or SIGINT (or the SuperNode's death), the ClientApp has this long to exit; then the
# whole namespace is killed (a bundle's handler could ignore the signal and never return).
GRACE_S = 10.0
EX_CONFIG = 78  # sysexits.h: a configuration error
# A mount namespace with its own /proc: with the host's /proc a bundle read the agent worker's CPU time
# (/proc/<pid>/task/<tid>/schedstat, readable by any uid), which reply pacing does not hide (privacy.md §8).
UNSHARE = ("--user", "--map-current-user", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc")
# What the ClientApp keeps of the SuperNode's environment (Flower's own variables are kept too).
KEEP = ("PATH", "LANG", "LC_ALL", "TZ", "SSL_CERT_FILE", "SSL_CERT_DIR")
RUN_FLOWER = (
    "import sys; from flwr.supernode.cli import flwr_clientapp; "
    "sys.argv[0] = 'flwr-clientapp'; sys.exit(flwr_clientapp())"
)


def _log(text: str) -> None:
    print(f"[fedfilter-clientapp] {text}", file=sys.stderr, flush=True)


def _split_parent(argv: list[str]) -> tuple[list[str], int | None]:
    """``--parent-pid N`` names a PID of the outer namespace: the wrapper watches it, not the ClientApp."""
    out, parent, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--parent-pid" and i + 1 < len(argv):
            parent = int(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--parent-pid="):
            parent = int(argv[i].split("=", 1)[1])
        else:
            out.append(argv[i])
        i += 1
    return out, parent


def namespaces_work(unshare: str) -> str | None:
    """None when an unprivileged PID namespace can be made here, else why not."""
    try:
        probe = subprocess.run([unshare, *UNSHARE, "true"], capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        return f"{unshare}: {exc}"
    return None if probe.returncode == 0 else (probe.stderr.strip() or f"exit code {probe.returncode}")


def main(argv: list[str] | None = None) -> int:
    args, parent = _split_parent(list(sys.argv[1:] if argv is None else argv))
    mode = os.environ.get(ISOLATION_ENV, "pidns")
    if mode not in ("pidns", "none"):
        _log(f"{ISOLATION_ENV}: expected 'pidns' (default) or 'none', found {mode!r}; not starting the ClientApp")
        return EX_CONFIG
    prefix: list[str] = []
    if mode == "pidns":
        unshare = shutil.which("unshare", path=os.environ.get("PATH", os.defpath)) or "unshare"
        why = namespaces_work(unshare)
        if why is not None:
            _log(
                f"cannot start the ClientApp in a PID namespace of its own ({why}); a process it starts could "
                f"outlive its run. Enable user namespaces, or set {ISOLATION_ENV}=none and contain the "
                "SuperNode's processes otherwise (docs/deploy.md §9)"
            )
            return EX_CONFIG
        prefix = [unshare, *UNSHARE]
    run_dir = Path(tempfile.mkdtemp(prefix="fedfilter-clientapp-"))  # 0700, this user's
    (run_dir / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k in KEEP or (k.startswith("FLWR_") and k != "FLWR_HOME")}
    env |= {"FLWR_HOME": str(run_dir / "flwr"), "HOME": str(run_dir), "TMPDIR": str(run_dir / "tmp")}
    env |= {"PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-I", "-c", RUN_FLOWER, *args],
        env=env,
        cwd=run_dir,
        start_new_session=True,  # one process group: a signal reaches unshare and the ClientApp
        preexec_fn=_die_with_parent,  # this wrapper killed: unshare dies, and --kill-child takes the rest
    )

    def kill_later() -> None:
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            _log(f"the ClientApp did not exit within {GRACE_S:.0f} s of a stop signal; killing its namespace")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # unshare dies, and --kill-child takes PID 1 and the rest

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)
        threading.Thread(target=kill_later, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    if parent is not None:

        def watch() -> None:  # Flower's own parent monitor, from outside the namespace
            while proc.poll() is None:
                if not _alive(parent):
                    forward(signal.SIGINT, None)
                    return
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True).start()
    try:
        return proc.wait()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the wrapper dies (prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
        os._exit(EX_CONFIG)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_shim(bin_dir: Path, python: str) -> Path:
    """Write ``bin_dir/flwr-clientapp``: this file, run by ``python`` (an interpreter with Flower)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "flwr-clientapp"
    source = Path(__file__).read_text()
    tmp = shim.with_name(f".flwr-clientapp.{os.getpid()}.{threading.get_ident()}.tmp")  # concurrent writers
    tmp.write_text(f"#!{python}\n" + source + '\n\nif __name__ == "__main__":\n    raise SystemExit(main())\n')
    tmp.chmod(0o755)
    tmp.replace(shim)
    return shim
