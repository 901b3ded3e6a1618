"""What every page of a build is drawn from, read once: the page definitions, runs, rows, references."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import altair as alt
import polars as pl

from workbench.dashboard.groups import Group, group_runs, measured_sweeps
from workbench.dashboard.pages import AblationPage, PagesSpec
from workbench.runstore import RunStore

SUMMARY_TABLE = "summary"


@dataclass(frozen=True, eq=False)
class BuildContext:
    """What every page is built from, read once."""

    spec: PagesSpec
    store: RunStore
    runs: pl.DataFrame
    params: Mapping[str, Mapping[str, Any]]
    summary: pl.DataFrame
    refs: pl.DataFrame
    seeds_path: Path
    colors: alt.Scale
    built_at: str

    def groups(self, ablation: str, page: AblationPage, *, quick: bool) -> list[Group]:
        sweeps = measured_sweeps(self.summary.filter(pl.col("ablation") == ablation), page.x) \
            if "ablation" in self.summary.columns else {}
        return group_runs(self.runs, self.params, ablation, page, quick=quick, sweeps=sweeps)

    def colors_for(self, hardware: list[str]) -> alt.Scale:
        """The build's colours of these machines only (a legend lists what the chart draws)."""
        domain, colors = list(self.colors.domain), list(self.colors.range)
        keep = sorted(set(hardware))
        return alt.Scale(domain=keep, range=[colors[domain.index(h)] for h in keep])

    def rows_of(self, run_ids: list[str]) -> pl.DataFrame:
        if self.summary.is_empty() or "run_id" not in self.summary.columns:
            return pl.DataFrame()
        rows = self.summary.filter(pl.col("run_id").is_in(run_ids))
        return rows.select([c for c in rows.columns if rows[c].null_count() < rows.height])
