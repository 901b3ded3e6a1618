"""The page definitions, `dashboards/pages.toml`: what each page draws and every column in words.

`load_pages` reads and checks the file into frozen dataclasses; any fault is one
WorkbenchError line that names the table and key.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from workbench.errors import WorkbenchError

DEFAULT_PAGES = Path(__file__).resolve().parents[2] / "dashboards" / "pages.toml"


@dataclass(frozen=True)
class ColumnLabel:
    """A column in words: `label (unit)` on axes; `divide_by` rescales it (bytes to GiB)."""

    label: str
    unit: str = ""
    divide_by: float = 1.0
    format: str | None = None
    log: bool = False

    def __post_init__(self) -> None:
        if not self.label.strip():
            raise WorkbenchError("a column label must not be empty")
        if not self.divide_by > 0:
            raise WorkbenchError(f"divide_by={self.divide_by!r} of {self.label!r} must be positive")

    @property
    def title(self) -> str:
        return f"{self.label} ({self.unit})" if self.unit else self.label


@dataclass(frozen=True)
class AblationPage:
    """One ablation's page: its x axis, the metrics drawn, and what defines a group."""

    name: str
    page: str
    title: str
    about: str
    x: str
    metrics: tuple[str, ...]
    x_params: tuple[str, ...] = ()
    panel: str | None = None
    ignore_params: tuple[str, ...] = ()
    # parameters a run's manifest may lack because it predates them, with the value such a run
    # had: a missing one is taken as this, so adding an option does not split old runs off
    param_defaults: Mapping[str, Any] = field(default_factory=dict)
    reference: tuple[str, ...] = ()
    # reference configurations (data/reference's `configuration`, by prefix) drawn beside the
    # `reference` metrics whatever machine they ran on: a published screen this page rebuilds
    # (seed 002's paging cliff); the other reference figures are the same machines' only
    reference_configurations: tuple[str, ...] = ()
    # a metric's name in the reference tables where it differs from ours (pages_out = "page_out")
    reference_names: Mapping[str, str] = field(default_factory=dict)
    history: str | None = None
    tooltip: tuple[str, ...] = ()
    x_words: str | None = None
    labels: Mapping[str, ColumnLabel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.page.endswith(".html") or "/" in self.page or self.page in _FIXED_PAGES:
            raise WorkbenchError(f"ablation {self.name}: page={self.page!r} must be a file name ending in .html, "
                                 f"not one of {', '.join(_FIXED_PAGES)}")
        if not self.metrics:
            raise WorkbenchError(f"ablation {self.name}: metrics must name at least one column")
        for key, names in (("reference", self.reference), ("history", (self.history,) if self.history else ())):
            stray = [n for n in names if n not in self.metrics]
            if stray:
                raise WorkbenchError(f"ablation {self.name}: {key} names {', '.join(stray)}, which is not in metrics")

    @property
    def quick_page(self) -> str:
        return self.page.removesuffix(".html") + "-quick.html"

    def drops(self, params: Mapping[str, Any]) -> set[str]:
        """Parameters left out of a group's key: the ignored ones, the model's file name where
        its sha256 names it, and the x list (the key takes the sweep in one form instead)."""
        out = {*self.x_params, *self.ignore_params}
        if "model_sha256" in params:
            out.add("model")
        return out


@dataclass(frozen=True)
class PagesSpec:
    """The whole of dashboards/pages.toml."""

    columns: Mapping[str, ColumnLabel]
    ablations: tuple[AblationPage, ...]
    overview_ablation: str = "bench"
    overview_metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        pages = [a.page for a in self.ablations] + [a.quick_page for a in self.ablations]
        if len(set(pages)) != len(pages):
            raise WorkbenchError(f"two ablations share a page name: {', '.join(sorted(pages))}")
        for a in self.ablations:
            needed = [a.x, *a.metrics, *([a.panel] if a.panel else [])]
            missing = [c for c in needed if c not in self.columns and c not in a.labels]
            if missing:
                raise WorkbenchError(f"ablation {a.name}: no [columns] entry for {', '.join(missing)}; "
                                     "add a label and unit for each")
        missing = [c for c in self.overview_metrics if c not in self.columns]
        if missing:
            raise WorkbenchError(f"[overview] metrics: no [columns] entry for {', '.join(missing)}")

    def ablation(self, name: str) -> AblationPage | None:
        return next((a for a in self.ablations if a.name == name), None)

    def label(self, column: str, ablation: AblationPage | None = None) -> ColumnLabel:
        if ablation is not None and column in ablation.labels:
            return ablation.labels[column]
        if column in self.columns:
            return self.columns[column]
        raise WorkbenchError(f"column {column!r} has no label in the page definitions; add it to [columns]")


_FIXED_PAGES = ("index.html", "overview.html", "reference.html")


def load_pages(path: str | Path = DEFAULT_PAGES) -> PagesSpec:
    """Read and check a page-definition file; one WorkbenchError line for any fault."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkbenchError(f"cannot read the page definitions {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise WorkbenchError(f"{path} is not valid TOML: {exc}") from exc
    where = str(path)
    _only_keys(raw, ("columns", "overview", "ablation"), where)
    columns = {name: _build(ColumnLabel, spec, f"{where} [columns] {name}")
               for name, spec in _table(raw.get("columns", {}), f"{where} [columns]").items()}
    overview = _table(raw.get("overview", {}), f"{where} [overview]")
    _only_keys(overview, ("ablation", "metrics"), f"{where} [overview]")
    ablations = []
    for i, spec in enumerate(raw.get("ablation", [])):
        spec = dict(_table(spec, f"{where} [[ablation]] #{i + 1}"))
        labels = _table(spec.pop("labels", {}), f"{where} ablation labels")
        spec["labels"] = {k: _build(ColumnLabel, v, f"{where} ablation labels {k}") for k, v in labels.items()}
        ablations.append(_build(AblationPage, spec, f"{where} [[ablation]] {spec.get('name', i + 1)}"))
    return PagesSpec(columns, tuple(ablations), overview.get("ablation", "bench"),
                     tuple(overview.get("metrics", ())))


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise WorkbenchError(f"{where} must be a table, got {type(value).__name__}")
    return value


def _only_keys(table: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in table if k not in allowed]
    if unknown:
        raise WorkbenchError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")


def _build(cls, spec: Any, where: str):
    """A frozen dataclass from a TOML table: unknown or missing keys and wrong types refused."""
    spec = _table(spec, where)
    known = {f.name: f for f in fields(cls)}
    _only_keys(spec, tuple(known), where)
    values = {}
    for name, f in known.items():
        if name not in spec:
            continue
        value, kind = spec[name], str(f.type)
        if name == "reference_names":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise WorkbenchError(f"{where}: {name} must be a table of column = reference metric name")
            value = dict(value)
        elif name == "param_defaults":
            if not isinstance(value, dict) or not all(isinstance(v, (str, int, float, bool)) for v in value.values()):
                raise WorkbenchError(f"{where}: {name} must be a table of parameter = text, number or boolean")
            value = dict(value)
        elif kind.startswith("tuple"):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise WorkbenchError(f"{where}: {name} must be a list of column or parameter names")
            value = tuple(value)
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise WorkbenchError(f"{where}: {name}={value!r} must be a number")
            value = float(value)
        elif kind == "bool" and not isinstance(value, bool):
            raise WorkbenchError(f"{where}: {name}={value!r} must be true or false")
        elif kind.startswith("str") and not isinstance(value, str):
            raise WorkbenchError(f"{where}: {name}={value!r} must be text")
        values[name] = value
    missing = [n for n, f in known.items()
               if n not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise WorkbenchError(f"{where}: missing key(s) {', '.join(missing)}")
    return cls(**values)
