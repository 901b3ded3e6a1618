"""Runs and groups: every recorded run, and the complete runs of an ablation grouped like with like.

A group is the runs of one ablation with the same parameters (those that say what was
measured, the sweep of x included; see `AblationPage.drops`) and the same quick flag.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from workbench.dashboard.pages import AblationPage
from workbench.errors import WorkbenchError
from workbench.runstore import RunStore, flatten_params

_SUBTITLE_WIDTH = 110  # characters per subtitle line before the parameter list wraps


@dataclass(frozen=True, eq=False)
class Group:
    """Complete runs measured alike: one ablation, the same parameters, quick or full.

    `runs` is one row per run (run_id, hardware_id, started_at, git_commit, device_run),
    oldest first; `latest` keeps each hardware's latest run, the one its line is drawn through.
    """

    ablation: str
    quick: bool
    params: Mapping[str, Any]
    runs: pl.DataFrame
    letter: str = "A"

    @property
    def latest(self) -> pl.DataFrame:
        return self.runs.group_by("hardware_id").agg(pl.all().sort_by("started_at").last()).sort("hardware_id")

    @property
    def hardware(self) -> list[str]:
        return sorted(self.runs["hardware_id"].unique().to_list())

    def runs_on(self, hardware_id: str) -> int:
        return self.runs.filter(pl.col("hardware_id") == hardware_id).height

    @property
    def name(self) -> str:
        return f"{self.ablation} group {self.letter}{' (quick)' if self.quick else ''}"

    def subtitle(self, hardware: list[str] | None = None, width: int = _SUBTITLE_WIDTH) -> list[str]:
        """The selection in words: ablation, quick/full, parameters, the runs each line comes from."""
        kind = "quick runs (--quick)" if self.quick else "full runs"
        lines = wrap(f"{self.name}: {kind}; parameters: ", [f"{k}={short(v)}" for k, v in self.params.items()],
                      width)
        latest = self.latest
        if hardware is not None:
            latest = latest.filter(pl.col("hardware_id").is_in(hardware))
        picks = [f"{r['hardware_id']} {r['run_id']} (latest of {self.runs_on(r['hardware_id'])})"
                 for r in latest.iter_rows(named=True)]
        lines += wrap("line per machine, through its latest complete run of the group: ", picks, width)
        return lines


def run_table(store: RunStore) -> tuple[pl.DataFrame, dict[str, dict[str, Any]]]:
    """Every recorded run (one row each, oldest first) and each run's parameters by run id.

    `quick` is the manifest's flag; a manifest written before the flag existed counts as a
    full run.
    """
    rows, params = [], {}
    for m in store.manifests():
        p = m.get("params") if isinstance(m.get("params"), dict) else {}
        params[m.get("run_id")] = p
        rows.append({
            "run_id": m.get("run_id"),
            "ablation": m.get("ablation"),
            "hardware_id": m.get("hardware_id"),
            "status": m.get("status"),
            "quick": bool(m.get("quick", p.get("quick", False))),
            "started_at": m.get("started_at"),
            "git_commit": m.get("git_commit"),
            "device_run": str(p.get("device_run", "")),
            "error": m.get("error"),
        })
    schema = {"run_id": pl.String, "ablation": pl.String, "hardware_id": pl.String, "status": pl.String,
              "quick": pl.Boolean, "started_at": pl.String, "git_commit": pl.String, "device_run": pl.String,
              "error": pl.String}
    return pl.DataFrame(rows, schema=schema).sort("started_at", "run_id", nulls_last=True), params


def group_runs(runs: pl.DataFrame, params: Mapping[str, Mapping[str, Any]], ablation: str,
               page: AblationPage | None, *, quick: bool, sweeps: Mapping[str, str] | None = None) -> list[Group]:
    """The complete runs of `ablation` (quick or full) in groups, the most-run group first.

    `sweeps` (run id -> the x values its rows hold, see `measured_sweeps`) stands in for the x
    list of runs whose manifest does not record it, so that a smoke run at one or two x values
    forms a group of its own instead of becoming the latest run of a full sweep's group.
    """
    chosen = runs.filter((pl.col("ablation") == ablation) & (pl.col("status") == "complete")
                         & (pl.col("quick") == quick))
    keys: dict[str, dict[str, Any]] = {}
    key_of = []
    for run_id in chosen["run_id"]:
        key = measurement_params(params.get(run_id, {}), page, (sweeps or {}).get(run_id))
        text = json.dumps(key, sort_keys=True, default=str)
        keys[text] = key
        key_of.append(text)
    chosen = chosen.with_columns(pl.Series("group_key", key_of, dtype=pl.String))
    found = [(members.height, members["started_at"].max() or "", text, members.drop("group_key"))
             for (text,), members in chosen.group_by("group_key", maintain_order=True)]
    found.sort(key=lambda g: g[:2], reverse=True)  # most runs first; ties: the one run last
    return [Group(ablation, quick, keys[text], members, _letter(i)) for i, (_, _, text, members) in enumerate(found)]


def measurement_params(params: Mapping[str, Any], page: AblationPage | None,
                       measured: str | None = None) -> dict[str, Any]:
    """The parameters that say what a run measured (flattened, sorted; see `AblationPage.drops`),
    with the sweep of x as one entry: the x list as the manifest records it, else `measured`
    (the x values of the run's rows, JSON text)."""
    try:
        flat = flatten_params(params)
    except WorkbenchError:  # a manifest from before the collision check: keep it as it is
        flat = dict(params)
    if page is None:
        return {k: flat[k] for k in sorted(flat) if k != "repeats"}
    flat = {**page.param_defaults, **flat}  # (a run from before a parameter existed had its default)
    key = {k: flat[k] for k in flat if k not in page.drops(flat)}
    recorded = next((p for p in page.x_params if p in flat), None)
    if recorded is not None:
        key[recorded] = flat[recorded]
    elif measured is not None:
        key[page.x_params[0] if page.x_params else page.x] = measured
    return dict(sorted(key.items()))


def measured_sweeps(summary: pl.DataFrame, x: str) -> dict[str, str]:
    """Run id -> the sorted x values of its rows, as JSON text ("[1, 4, 16]")."""
    if summary.is_empty() or x not in summary.columns:
        return {}
    found = summary.filter(pl.col(x).is_not_null()).group_by("run_id").agg(pl.col(x).unique().sort())
    return {run_id: json.dumps(values) for run_id, values in found.iter_rows()}


def _letter(i: int) -> str:
    return chr(ord("A") + i) if i < 26 else f"A{i}"


def short(value: Any, limit: int = 40) -> str:
    text = "null" if value is None else str(value)
    if len(text) == 64 and all(c in "0123456789abcdef" for c in text):  # a sha256: its first 12 digits
        return text[:12] + "…"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def wrap(head: str, items: list[str], width: int = _SUBTITLE_WIDTH) -> list[str]:
    """`head` and the items, comma-separated, in lines of about `width` characters (Vega does
    not wrap titles)."""
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + (", " if i < len(items) - 1 else "")
        if len(line) + len(piece) > width and line.strip():
            lines.append(line.rstrip())
            line = "    "
        line += piece
    lines.append(line.rstrip() if items else line + "(none)")
    return lines
