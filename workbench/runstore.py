"""Run store: one folder per run, a JSON manifest and tidy parquet tables, written atomically.

Layout under the store's root (default ``./data``)::

    runs/<run_id>/manifest.json      what ran: ablation, params, quick, hardware, commit, versions, status
    runs/<run_id>/<name>.parquet     tidy rows; every row carries run_id, ablation, hardware_id
                                     and the run's params (flattened, nested keys joined by "_")

Every file is written to a temporary file in the same folder and moved into place with
`os.replace`, so a reader (or a process killed mid-run) only ever sees whole files. A run
used as a context manager ends "complete", or "failed" with the error line and its parquet
tables removed; a killed process leaves the manifest at "running" and only whole tables.

A manifest's `params` are the run's full parameters as its maker passes them (an ablation
passes every parameter, defaults filled in); its top-level boolean `quick` says whether the
run used reduced settings (an ablation's --quick; see `workbench.ablations`), so that readers
keep quick runs apart from full ones. A manifest written before `quick` existed reads as
quick = False. A field filled in or fixed after the run is listed in `corrections`, with a note.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
from collections.abc import Mapping
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import polars as pl

from workbench.errors import WorkbenchError

MANIFEST = "manifest.json"
RUNS_DIR = "runs"
RUN_STATUSES = ("running", "complete", "failed")
ID_COLUMNS = ("run_id", "ablation", "hardware_id")
# Distributions recorded in each manifest, keyed by the name a reader knows them by.
VERSIONED = {
    "workbench": "slotlab",
    "torch": "torch",
    "triton": "triton",
    "numpy": "numpy",
    "polars": "polars",
    "pyarrow": "pyarrow",
    "altair": "altair",
    "gguf": "gguf",
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_RUN_COLUMNS = {
    "run_id": pl.String,
    "ablation": pl.String,
    "hardware_id": pl.String,
    "status": pl.String,
    "started_at": pl.String,
    "ended_at": pl.String,
    "duration_s": pl.Float64,
    "git_commit": pl.String,
    "git_dirty": pl.Boolean,
    "quick": pl.Boolean,
    "tables": pl.String,
    "error": pl.String,
    "params": pl.String,
}


from .atomic import atomic_write_bytes, atomic_write_parquet, atomic_write_text  # noqa: E402,F401  (re-exported)


class Run:
    """One recorded run: its manifest and its parquet tables. Made by `RunStore.start_run`."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self._manifest = manifest
        self._columns = {
            "run_id": manifest["run_id"],
            "ablation": manifest["ablation"],
            "hardware_id": manifest["hardware_id"],
            **flatten_params(manifest["params"]),
        }

    @property
    def run_id(self) -> str:
        return self._manifest["run_id"]

    @property
    def status(self) -> str:
        return self._manifest["status"]

    @property
    def manifest(self) -> dict[str, Any]:
        """A copy of the manifest as last written."""
        return json.loads(json.dumps(self._manifest))

    def write_rows(self, name: str, rows: list[dict[str, Any]] | pl.DataFrame) -> Path:
        """Add `rows` to the table `name` (appending to what this run already wrote there).

        Each row gets run_id, ablation, hardware_id and the flattened params as columns. A row
        column may repeat one of those names only with the same value everywhere.
        """
        self._require_running("write rows")
        _check_name(name, "table name")
        if name == Path(MANIFEST).stem:
            raise WorkbenchError(f"table name {name!r} is reserved; choose another")
        frame = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(rows, infer_schema_length=None)
        frame = self._tag(frame)
        target = self.path / f"{name}.parquet"
        if target.exists():
            frame = pl.concat([pl.read_parquet(target), frame], how="diagonal_relaxed")
        atomic_write_parquet(target, frame)
        if name not in self._manifest["tables"]:
            self._manifest["tables"].append(name)
            self._save()
        return target

    def finish(self, status: str = "complete", error: str | None = None) -> None:
        """End the run: record the status and end time; a failed run loses its parquet tables."""
        self._require_running("finish")
        if status not in ("complete", "failed"):
            raise WorkbenchError(f"finish status {status!r} is not allowed; use 'complete' or 'failed'")
        if status == "failed":
            for table in self.path.glob("*.parquet"):
                table.unlink(missing_ok=True)
            self._manifest["tables"] = []
        for leftover in self.path.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)
        self._manifest.update(status=status, ended_at=_now(), error=error)
        self._save()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.status != "running":
            return
        if exc is None:
            self.finish("complete")
        else:
            self.finish("failed", error=_error_line(exc))

    def _tag(self, frame: pl.DataFrame) -> pl.DataFrame:
        for column, value in self._columns.items():
            if column in frame.columns and not _all_equal(frame, column, value):
                raise WorkbenchError(
                    f"row column {column!r} differs from the run's {column} = {value!r}; "
                    "rename the column or drop it from the rows"
                )
        measured = [c for c in frame.columns if c not in self._columns]
        tags = [pl.lit(value, dtype=_dtype(value)).alias(column) for column, value in self._columns.items()]
        return frame.with_columns(tags).select(*self._columns, *measured)

    def _require_running(self, action: str) -> None:
        if self.status != "running":
            raise WorkbenchError(f"cannot {action}: run {self.run_id} is already {self.status}")

    def _save(self) -> None:
        atomic_write_text(self.path / MANIFEST, json.dumps(self._manifest, indent=2, default=str) + "\n")


class RunStore:
    """Runs under `root/runs`; `root` defaults to ./data."""

    def __init__(self, root: str | Path = "data") -> None:
        self.root = Path(root)
        self._hardware: dict[str, Any] | None = None

    @property
    def runs_dir(self) -> Path:
        return self.root / RUNS_DIR

    def start_run(
        self,
        ablation: str,
        params: Mapping[str, Any],
        *,
        hardware: Mapping[str, Any] | None = None,
        quick: bool = False,
    ) -> Run:
        """Create a run folder and its manifest (status "running"); use the Run as a context manager.

        `hardware` defaults to this machine's `hardware.fingerprint()`; pass one (it must hold a
        `hardware_id`) to record runs made elsewhere or, in tests, on fake machines. `quick`:
        the run used reduced settings (recorded as the manifest's top-level `quick`).
        """
        _check_name(ablation, "ablation")
        if not isinstance(params, Mapping):
            raise WorkbenchError(f"params must be a mapping, got {type(params).__name__}")
        if not isinstance(quick, bool):
            raise WorkbenchError(f"quick={quick!r} is not allowed: allowed True or False")
        flatten_params(params)  # reject colliding keys before anything is written
        hw = dict(hardware) if hardware is not None else self._this_machine()
        if not hw.get("hardware_id"):
            raise WorkbenchError("hardware must hold a non-empty 'hardware_id'")
        started = datetime.now(timezone.utc)
        run_id = f"{started:%Y%m%dT%H%M%S}Z-{secrets.token_hex(3)}"
        commit, dirty = _git_state(Path(__file__).resolve().parent)
        manifest = {
            "schema": 1,
            "run_id": run_id,
            "ablation": ablation,
            "params": json.loads(json.dumps(dict(params), default=str)),
            "quick": quick,
            "hardware_id": hw["hardware_id"],
            "hardware": hw,
            "git_commit": commit,
            "git_dirty": dirty,
            "versions": _versions(),
            "started_at": started.isoformat(),
            "ended_at": None,
            "status": "running",
            "error": None,
            "tables": [],
        }
        path = self.runs_dir / run_id
        path.mkdir(parents=True, exist_ok=False)
        run = Run(path, manifest)
        run._save()
        return run

    def manifests(self) -> list[dict[str, Any]]:
        """Every run's manifest, oldest first; an unreadable one appears with status "unreadable"."""
        if not self.runs_dir.is_dir():
            return []
        out = []
        for path in sorted(self.runs_dir.glob(f"*/{MANIFEST}")):
            try:
                out.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError) as exc:
                out.append({"run_id": path.parent.name, "status": "unreadable", "error": _error_line(exc)})
        return out

    def list_runs(
        self,
        ablation: str | None = None,
        hardware: str | None = None,
        status: str | None = None,
        quick: bool | None = None,
    ) -> pl.DataFrame:
        """One row per run (see `_RUN_COLUMNS`), oldest first, optionally filtered.

        `quick` is the manifest's flag (False where the manifest lacks it); filter with
        quick=True (quick runs only) or quick=False (full runs only).
        """
        if status is not None and status not in RUN_STATUSES:
            raise WorkbenchError(f"status {status!r} is not one of {', '.join(RUN_STATUSES)}")
        if quick is not None and not isinstance(quick, bool):
            raise WorkbenchError(f"quick={quick!r} is not allowed: allowed True, False or None (every run)")
        rows = [_run_row(m) for m in self.manifests()]
        frame = pl.DataFrame(rows, schema=_RUN_COLUMNS)
        for column, value in (("ablation", ablation), ("hardware_id", hardware), ("status", status),
                              ("quick", quick)):
            if value is not None:
                frame = frame.filter(pl.col(column) == value)
        return frame

    def load(self, name: str, *, run_status: str | None = "complete", **filters: Any) -> pl.DataFrame:
        """All runs' `<name>.parquet` concatenated (diagonally: missing columns become null).

        `run_status` keeps runs with that manifest status (None: every run that has the table).
        Each keyword filter keeps rows whose column equals the value, or is in it if it is a
        list, tuple or set.
        """
        _check_name(name, "table name")
        runs = self.list_runs(status=run_status) if run_status is not None else self.list_runs()
        paths = [self.runs_dir / rid / f"{name}.parquet" for rid in runs["run_id"]]
        frames = [pl.read_parquet(p) for p in paths if p.exists()]
        if not frames:
            return pl.DataFrame()
        frame = pl.concat(frames, how="diagonal_relaxed")
        for column, value in filters.items():
            if column not in frame.columns:
                raise WorkbenchError(
                    f"cannot filter on {column!r}: table {name!r} has columns {', '.join(frame.columns)}"
                )
            if isinstance(value, (list, tuple, set, frozenset)):
                frame = frame.filter(pl.col(column).is_in(list(value)))
            else:
                frame = frame.filter(pl.col(column) == value)
        return frame

    def _this_machine(self) -> dict[str, Any]:
        if self._hardware is None:
            from workbench.hardware import fingerprint

            self._hardware = fingerprint()
        return self._hardware


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings joined with "_" ({"engine": {"chunk": 4}} -> {"engine_chunk": 4}).

    Scalars stay as they are; lists and other values become JSON text so that every
    param is one parquet column of a plain type.
    """
    flat: dict[str, Any] = {}
    for key, value in params.items():
        column = f"{prefix}{key}"
        items = (
            flatten_params(value, f"{column}_").items()
            if isinstance(value, Mapping)
            else [(column, _plain(value))]
        )
        for k, v in items:
            if k in flat or k in ID_COLUMNS:
                raise WorkbenchError(f"param {k!r} collides with another param or an id column; rename it")
            flat[k] = v
    return flat


def _all_equal(frame: pl.DataFrame, column: str, value: Any) -> bool:
    if value is None:
        return frame[column].is_null().all()
    try:
        # a null cell (a row that lacks the column) takes the param's value like every other row
        return bool(frame.select((pl.col(column) == pl.lit(value)).fill_null(True).all()).item())
    except pl.exceptions.PolarsError:  # incomparable types
        return False


def _dtype(value: Any) -> pl.DataType:
    """Widest plain dtype, so that the same param has one type across runs."""
    if isinstance(value, bool):
        return pl.Boolean()
    if isinstance(value, int):
        return pl.Int64()
    if isinstance(value, float):
        return pl.Float64()
    if value is None:
        return pl.Null()
    return pl.String()


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, default=str)


def _run_row(m: Mapping[str, Any]) -> dict[str, Any]:
    duration = None
    if m.get("started_at") and m.get("ended_at"):
        delta = datetime.fromisoformat(m["ended_at"]) - datetime.fromisoformat(m["started_at"])
        duration = delta.total_seconds()
    return {
        "run_id": m.get("run_id"),
        "ablation": m.get("ablation"),
        "hardware_id": m.get("hardware_id"),
        "status": m.get("status"),
        "started_at": m.get("started_at"),
        "ended_at": m.get("ended_at"),
        "duration_s": duration,
        "git_commit": m.get("git_commit"),
        "git_dirty": m.get("git_dirty"),
        "quick": m.get("quick") is True,
        "tables": ",".join(m.get("tables") or []),
        "error": m.get("error"),
        "params": json.dumps(m.get("params"), sort_keys=True) if "params" in m else None,
    }


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise WorkbenchError(
            f"{what} {name!r} is not allowed; use letters, digits, '_', '-', '.', starting with a letter or digit"
        )


def _git_state(where: Path) -> tuple[str | None, bool | None]:
    """(HEAD commit, tracked files modified) of the repo holding `where`; (None, None) outside one.
    SLOTLAB_GIT_COMMIT, where set, names the commit instead (dirty unknown): for copies of the
    tree whose .git lags behind it, as on the device machine."""
    override = os.environ.get("SLOTLAB_GIT_COMMIT")
    if override:
        return override, None

    def git(*args: str) -> subprocess.CompletedProcess[str] | None:
        try:
            return subprocess.run(
                ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return None

    inside = git("rev-parse", "--is-inside-work-tree")
    if inside is None or inside.returncode != 0:
        return None, None
    head = git("rev-parse", "HEAD")
    commit = head.stdout.strip() if head is not None and head.returncode == 0 else None
    # Untracked files are not counted: recorded runs under data/ are untracked until committed.
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = bool(status.stdout.strip()) if status is not None and status.returncode == 0 else None
    return commit, dirty


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for key, dist in VERSIONED.items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


# ---- CLI glue -------------------------------------------------------------------------------


def register_cli(subparsers) -> None:
    """Add `workbench runs` to an argparse subparsers object."""
    p = subparsers.add_parser("runs", help="list recorded runs", description="List recorded runs, oldest first.")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="run store root")
    p.add_argument("--ablation", help="only runs of this ablation (default: every ablation)")
    p.add_argument("--hardware", help="only runs on this hardware_id (default: any hardware)")
    p.add_argument("--status", choices=RUN_STATUSES, help="only runs with this status (default: any status)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--quick", dest="quick", action="store_const", const=True,
                       help="only quick runs, made with an ablation's --quick settings (default: quick and full runs)")
    which.add_argument("--full", dest="quick", action="store_const", const=False,
                       help="only full runs, not quick (default: quick and full runs)")
    p.set_defaults(func=_cmd_runs)


def _cmd_runs(args) -> int:
    store = RunStore(args.data_dir)
    runs = store.list_runs(ablation=args.ablation, hardware=args.hardware, status=args.status, quick=args.quick)
    if runs.is_empty():
        print(f"no runs in {store.runs_dir}" + (" matching the filters" if _any_filter(args) else ""))
        return 0
    shown = runs.select(
        "run_id",
        "ablation",
        "hardware_id",
        "status",
        "quick",
        pl.col("started_at").str.slice(0, 19).alias("started (UTC)"),
        pl.col("duration_s").round(1),
        pl.col("git_commit").str.slice(0, 10).alias("commit"),
        "tables",
    )
    with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=80, tbl_width_chars=10_000,
                   tbl_formatting="MARKDOWN", tbl_hide_dataframe_shape=True, tbl_hide_column_data_types=True):
        print(shown)
    print(f"{runs.height} run(s) in {store.runs_dir}")
    return 0


def _any_filter(args) -> bool:
    return any(v is not None for v in (args.ablation, args.hardware, args.status, args.quick))

