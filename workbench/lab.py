"""`workbench lab`: JupyterLab on the project's notebooks, in this environment.

    workbench lab                    # notebooks/ on 127.0.0.1:8888, prints the URL with its token
    workbench lab explore.ipynb      # the same, opening the explorer
    workbench lab --port 0           # any free port

The URL carries a fresh token each start (JUPYTER_TOKEN, if set, fixes it). The server runs
in this process (its PID is the server's) and its kernels run this interpreter, so
`import workbench` works in every notebook. Ctrl-C or SIGTERM stops it at once, kernels
included, with exit code 0; there is no "shut down? y/n" prompt. No browser is opened where
there is no display (a text browser would take over the terminal).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from .errors import WorkbenchError

DEFAULT_PORT = 8888


@dataclass(frozen=True)
class LabConfig:
    """Where JupyterLab serves from and listens. `open_browser` None: only where a display is."""

    root_dir: Path
    ip: str = "127.0.0.1"
    port: int = DEFAULT_PORT  # 0: a free port chosen by the OS
    notebook: str | None = None  # opened first, relative to root_dir
    open_browser: bool | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise WorkbenchError(f"port {self.port} is out of range: allowed 0..65535 (0: any free port)")
        if not self.ip.strip():
            raise WorkbenchError("ip is empty: give an address to listen on, e.g. 127.0.0.1")
        if self.notebook is not None and (Path(self.notebook).is_absolute() or ".." in Path(self.notebook).parts):
            raise WorkbenchError(f"notebook {self.notebook!r} must be a path inside the notebook folder")


def has_display() -> bool:
    """Whether a browser opened here would appear on a screen (not a text browser in this terminal)."""
    if sys.platform in ("darwin", "win32"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def _check_paths(cfg: LabConfig) -> None:
    if not cfg.root_dir.is_dir():
        raise WorkbenchError(f"notebook folder {cfg.root_dir} does not exist: pass --notebook-dir")
    if cfg.notebook is not None and not (cfg.root_dir / cfg.notebook).is_file():
        found = ", ".join(sorted(p.name for p in cfg.root_dir.glob("*.ipynb"))) or "none"
        raise WorkbenchError(f"no notebook {cfg.notebook!r} in {cfg.root_dir}; notebooks there: {found}")


def serve(cfg: LabConfig, *, out=None) -> int:
    """Run JupyterLab until Ctrl-C or SIGTERM; prints its URL (with the token) once it listens."""
    out = out or sys.stdout
    _check_paths(cfg)
    try:
        from jupyterlab.labapp import LabApp
    except ImportError:
        raise WorkbenchError("jupyterlab is not installed: pip install -e . installs it") from None

    # JUPYTER_TOKEN is Jupyter's own way to fix the token; otherwise a fresh one, printed below
    # (passing it in tells Jupyter not to print its own, with the rest of its start-up log).
    token = os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    open_browser = has_display() if cfg.open_browser is None else cfg.open_browser
    argv = [
        f"--ServerApp.root_dir={cfg.root_dir.resolve()}",
        f"--ServerApp.ip={cfg.ip}",
        f"--ServerApp.port={cfg.port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.open_browser={open_browser}",
        # Our lines say where it is; Jupyter's warnings and errors still show.
        "--ServerApp.log_level=WARN",
        "--LabApp.log_level=WARN",
    ]
    if cfg.notebook is not None:
        argv.append(f"--ServerApp.file_to_run={cfg.root_dir.resolve() / cfg.notebook}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # These machines (and CI) run everything as root; Jupyter refuses root unless told.
        argv.append("--ServerApp.allow_root=True")

    server = LabApp.initialize_server(argv=argv)

    # Ctrl-C and SIGTERM stop it at once, kernels included. Jupyter's own handlers (signal.signal)
    # ask "shut down? y/n" on a tty, and can sit unserved while the loop sleeps if the signal
    # lands on another of its threads; the event loop's handlers wake the loop.
    def stop(signame: str) -> None:
        print(f"{signame}: stopping JupyterLab and its kernels...", file=out, flush=True)
        server.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        server.io_loop.asyncio_loop.add_signal_handler(sig, stop, sig.name)
    path = f"lab/tree/{urllib.parse.quote(cfg.notebook)}" if cfg.notebook else "lab"
    url = f"{server.connection_url.rstrip('/')}/{path}?{urllib.parse.urlencode({'token': token})}"

    def announce() -> None:  # queued after the socket bind, so it runs once the server listens
        print(f"JupyterLab is serving {cfg.root_dir} at\n    {url}\nCtrl-C stops it.", file=out, flush=True)

    server.io_loop.add_callback(announce)
    server.start()
    print("JupyterLab stopped.", file=out, flush=True)
    return 0


def register_cli(subparsers) -> None:
    """Add `workbench lab` to an argparse subparsers object."""
    from .ablations import NOTEBOOK_DIR
    from .cli import int_range

    p = subparsers.add_parser("lab", help="open the notebooks in JupyterLab",
                              description="Start JupyterLab on the project's notebooks and print its URL.")
    p.add_argument("notebook", nargs="?", default=None,
                   help="a notebook to open first, e.g. explore.ipynb (default: the file browser)")
    p.add_argument("--notebook-dir", type=Path, default=NOTEBOOK_DIR,
                   help="folder JupyterLab serves (default: the project's notebooks/)")
    p.add_argument("--ip", default=LabConfig.ip, help="address to listen on; 0.0.0.0 exposes it to the network")
    p.add_argument("--port", type=int_range(0, 65535), default=LabConfig.port,
                   help="port to listen on; 0 picks a free one, a busy one moves to the next free")
    p.add_argument("--browser", action=argparse.BooleanOptionalAction, default=None,
                   help="open a web browser on it (default: only when a display is available)")
    p.set_defaults(func=_cmd_lab)


def _cmd_lab(args) -> int:
    return serve(LabConfig(root_dir=args.notebook_dir, ip=args.ip, port=args.port, notebook=args.notebook,
                           open_browser=args.browser))
