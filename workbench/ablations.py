"""Ablations: a registry of parameterized notebooks, their parameters, and sweeps as run specs.

An ablation is a notebook under ``notebooks/`` with a papermill ``parameters`` cell of flat
literals. The registry names each one with its parameter spec (type, allowed values, default)
and its quick overrides. `validate` refuses a bad value before anything runs, naming the
parameter and what it allows; the notebook's second cell calls it too, so a notebook run by
hand in JupyterLab is checked the same way.

A sweep is a list of independent `RunSpec`s (`plan_sweep`): list-valued parameters (prompt
lengths, chunk sizes) are swept inside one run, because the run compares them; a scalar
parameter given several values is swept across runs, one `RunSpec` per combination. An
executor runs the specs; `LocalExecutor` runs them one after another through papermill.
Each run is recorded in the run store: the runner starts it, the notebook writes its tables
into it, the runner ends it ("complete", or "failed" with the error line) and saves the
executed notebook beside the tables in ``runs/<run_id>/``.

A run's manifest records its full parameters (defaults filled in) and whether it is quick: a
run planned with the quick overrides (`workbench ablate X --quick`, `run-all --quick`) is
quick, whatever else it overrides; a run started by hand (JupyterLab, papermill) is quick when
its parameters hold every quick override's value (`Ablation.is_quick`).

The chunk-sizing measurement itself (`measure_chunk_sizing`) lives here too, so that the
notebook holds only parameters and calls.
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from workbench.errors import WorkbenchError

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
# Parameters every ablation notebook has and the runner sets (never recorded): the run store's
# root, the run the notebook writes into (None: it starts its own) and its progress bars.
RUNNER_PARAMS = ("data_dir", "run_id", "progress")
SUMMARY_TABLE = "summary"  # the table the dashboards read (workbench.dashboard.SUMMARY_TABLE)
KERNEL_NAME = "python3"

# ---- parameter specs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One notebook parameter: its kind, default and allowed values.

    kind: "int" (an integer lo..hi), "int_list" (a non-empty list of distinct such integers,
    each item may also be one of `words`), "word" (one of `words`), "word_list" (a non-empty
    list of distinct `words`), or "path" (an existing file). Any kind may also be None where
    `optional`.
    """

    name: str
    kind: str
    default: Any
    help: str
    lo: int | None = None
    hi: int | None = None
    words: tuple[str, ...] = ()
    optional: bool = False
    # word_list: items may also match this regular expression (described by `forms`, e.g.
    # the proposers' "self:K" and "draft:PATH")
    pattern: str | None = None
    forms: str = ""

    @property
    def is_list(self) -> bool:
        return self.kind in ("int_list", "word_list")

    def allowed(self) -> str:
        none = " or None" if self.optional else ""
        if self.kind == "path":
            return "a path to an existing file" + none
        if self.kind == "word":
            return "one of " + ", ".join(map(repr, self.words)) + none
        if self.kind == "word_list":
            return ("a non-empty list of distinct values from " + ", ".join(map(repr, self.words))
                    + (f" or {self.forms}" if self.forms else ""))
        span = f"{self.lo}..{self.hi}" if self.hi is not None else f">= {self.lo}"
        if self.kind == "int":
            return f"an integer {span}{none}"
        extra = "".join(f" or {w!r}" for w in self.words)
        return f"a non-empty list of distinct integers {span}{extra}"

    def check(self, value: Any) -> Any:
        """The value, normalized (tuples to lists); WorkbenchError naming what is allowed.

        Text is first read as `parse` reads it (papermill's `-p prompt_lens '[32]'` passes the
        string "[32]", and `-r` passes every value as a string).
        """
        if isinstance(value, str):
            value = self.parse(value)
        if value is None and self.optional:
            return None
        if self.kind == "path":
            if not isinstance(value, (str, Path)) or not Path(value).is_file():
                raise self._refuse(value, "is not an existing file")
            return str(value)
        if self.kind == "int":
            self._check_int(value, value)
            return value
        if self.kind == "word":
            if not isinstance(value, str) or value not in self.words:
                raise self._refuse(value, "is not allowed")
            return value
        if not isinstance(value, (list, tuple)) or not value:
            raise self._refuse(value, "is not a non-empty list")
        for item in value:
            if self.kind == "word_list" and (not isinstance(item, str) or item not in self.words) and not (
                    isinstance(item, str) and self.pattern is not None and re.fullmatch(self.pattern, item)):
                raise self._refuse(value, f"has an item {item!r} not allowed")
            if self.kind == "int_list" and item not in self.words:
                self._check_int(item, value)
        if len(set(map(str, value))) != len(value):
            raise self._refuse(value, "repeats a value")
        return list(value)

    def parse(self, text: str) -> Any:
        """A value given as text: a Python or JSON literal ("7", "[7, 8]", "None", "null"), or
        bare words ("auto", "16,64,auto", "[16, auto]"). Several values make a list; one value
        of a list parameter becomes a list of one.

        Text that reads as neither stays text, and items that are not integers stay words, so
        that `check` names them in its message.
        """
        text = text.strip()
        if text.lower() in ("none", "null"):
            return None
        if self.kind == "path":
            return text
        value = _literal(text)
        if value is _NOT_LITERAL:
            bracketed = text.startswith("[") and text.endswith("]")
            if text.startswith("[") and not bracketed:
                return text
            inner = text[1:-1] if bracketed else text
            items = [p.strip().strip("'\"") for p in inner.split(",")]
            value = [int(p) if _is_int(p) else p for p in items if p]
            value = value if (bracketed or "," in text) else (value[0] if value else text)
        if isinstance(value, tuple):  # "7,8" reads as a tuple
            value = list(value)
        return [value] if self.is_list and not isinstance(value, list) else value

    def describe(self) -> str:
        return f"{self.name} = {self.default!r}: {self.help} (allowed: {self.allowed()})"

    def _check_int(self, item: Any, value: Any) -> None:
        if isinstance(item, bool) or not isinstance(item, int):
            raise self._refuse(value, "is not an integer" if self.kind == "int" else f"has a non-integer item {item!r}")
        if item < self.lo or (self.hi is not None and item > self.hi):
            raise self._refuse(value, "is out of range" if self.kind == "int" else f"has an item {item} out of range")

    def _refuse(self, value: Any, why: str) -> WorkbenchError:
        return WorkbenchError(f"{self.name}={value!r} {why}: allowed {self.allowed()}")


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


_NOT_LITERAL = object()


def _literal(text: str) -> Any:
    """`text` as a Python literal (`ast.literal_eval`: no names, no calls) or, failing that, a
    JSON one (null, true, false); `_NOT_LITERAL` if it is neither."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_LITERAL


def _flag(name: str, value: Any) -> bool:
    """A runner's on/off parameter: a bool, or its text ("True", "false")."""
    if isinstance(value, str):
        value = {"true": True, "false": False}.get(value.strip().lower(), value)
    if not isinstance(value, bool):
        raise WorkbenchError(f"{name}={value!r} is not allowed: allowed True or False")
    return value


@dataclass(frozen=True)
class Ablation:
    name: str
    notebook: str  # file name under notebooks/
    description: str
    params: tuple[Param, ...]
    quick: Mapping[str, Any] = field(default_factory=dict)  # overrides of --quick

    @property
    def notebook_path(self) -> Path:
        return NOTEBOOK_DIR / self.notebook

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise WorkbenchError(
            f"{self.name} has no parameter {name!r}; parameters: {', '.join(p.name for p in self.params)}"
        )

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def is_quick(self, params: Mapping[str, Any]) -> bool:
        """Whether validated `params` hold every quick override's value: how a run is classed
        when nobody said whether it was planned with --quick (a notebook run by hand, a run
        recorded before manifests held the flag)."""
        return bool(self.quick) and all(params.get(k) == v for k, v in self.quick.items())


def _chunk_sizing() -> Ablation:
    from workbench.engine_config import MAX_CONCURRENCY

    return Ablation(
        name="chunk-sizing",
        notebook="chunk_sizing.ipynb",
        description="prefill chunk size vs TTFT, the decode stall of other slots, throughput and memory; "
        "proves outputs are identical across chunk sizes",
        params=(
            Param("model", "path", None, "GGUF file (None: the embedded Gemma 3 270M)", optional=True),
            Param("concurrency", "int", 4, "slots; all but one decode while the long prompt prefills",
                  lo=2, hi=MAX_CONCURRENCY),
            Param("prompt_lens", "int_list", [256, 1024], "lengths of the long prompt that arrives", lo=1),
            Param("chunk_sizes", "int_list", [32, 128, 512, "auto"],
                  "prefill rows per step ('auto': sized from the memory budget, capped at chunk_cap)",
                  lo=1, words=("auto",)),
            Param("chunk_cap", "int", 4096, "most prefill rows an auto-sized step takes", lo=1),
            Param("gen_tokens", "int", 16, "tokens the long prompt generates", lo=1, hi=65536),
            Param("decode_prompt_len", "int", 16, "prompt length of the slots already decoding", lo=1),
            Param("repeats", "int", 3, "repeats of every measurement", lo=1, hi=1000),
            Param("seed", "int", 0, "seeds the prompts' text", lo=0, hi=2**63 - 1),
        ),
        quick={"concurrency": 2, "prompt_lens": [64, 256], "chunk_sizes": [16, 64, "auto"],
               "gen_tokens": 8, "repeats": 1},
    )


def _paging_cliff() -> Ablation:
    from workbench.engine_config import BACKENDS, MAX_CONCURRENCY, PREEMPTIONS, EngineConfig
    from workbench.paging_cliff import PFLASH

    return Ablation(
        name="paging-cliff",
        notebook="paging_cliff.ipynb",
        description="decode throughput against concurrency as the live KV outgrows the resident pool, paged to "
        "a host store (swap) or recomputed; checks tokens and logits against the all-resident run's, bitwise",
        params=(
            Param("model", "path", None, "GGUF file (None: the embedded Gemma 3 270M)", optional=True),
            Param("concurrencies", "int_list", [1, 4, 8, 16, 32],
                  "numbers of requests submitted together (the x axis; a row's concurrency)", lo=1, hi=MAX_CONCURRENCY),
            Param("resident_pools", "int_list", [8192], "device pool sizes, in positions per global KV group "
                  "(kv_resident_tokens; a row's resident_tokens; seed 002's was 8,192)", lo=1),
            Param("prompt_lens", "int_list", [2048],
                  "prompt tokens of every request (2,048: seed 002's ~2K effective prompts, ~32K live at C16)", lo=1),
            Param("gen_tokens", "int", 64, "tokens each request generates (seed 002: 64)", lo=1, hi=65536),
            Param("pflash_modes", "word_list", ["off"],
                  "prompt compression (a row's pflash): 'on' is prompt_compression='auto', which leaves prompts under "
                  "8,192 tokens whole (such a row is flagged), so give it long prompts in a run of its own "
                  "(-p pflash_modes=on -p prompt_lens=30720: ~2K kept, seed 002's other arm); crossing 'off' with "
                  "30K-token prompts would prefill and page C x 30K tokens through an 8K pool, most of the run",
                  words=tuple(PFLASH)),
            Param("preemptions", "word_list", list(PREEMPTIONS), "what a request preempted for pages does "
                  "(EngineConfig.preemption; a row's preemption)", words=PREEMPTIONS),
            Param("host_tokens", "int", None, "host store positions per global KV group (None: enough for every "
                  "request, so a swap never falls back to recompute)", lo=1, optional=True),
            Param("quantum", "int", EngineConfig().residency_quantum,
                  "steps a paged-in request runs before it may be paged out (residency_quantum)", lo=1),
            Param("backend", "word", "torch", "the engine's backend ('torch': the CPU path, 'triton': the GPU's)",
                  words=BACKENDS),
            Param("seed", "int", 0, "seeds the prompts' text", lo=0, hi=2**63 - 1),
        ),
        # Parameters are plural where a row column holds one of their values (the run store tags
        # every row with every parameter). Quick: the embedded model on a CPU; a 1,024-token pool
        # holds two requests of 256 + 8 tokens (two pages each), so the cliff is at C4 (8 pages
        # wanted, 4 held)
        quick={"concurrencies": [1, 2, 4], "resident_pools": [1024], "prompt_lens": [256], "gen_tokens": 8,
               "pflash_modes": ["off"], "preemptions": ["swap", "recompute"], "quantum": 4},
    )


def _draft_yield() -> Ablation:
    from workbench.draft_yield import GUARDS
    from workbench.engine_config import BACKENDS
    from workbench.spec import MAX_K
    from workbench.spec.config import MAX_TREE
    from workbench.workloads import WORKLOADS

    return Ablation(
        name="draft-yield",
        notebook="draft_yield.ipynb",
        description="goodput of speculative decoding against plain decoding on the same prompts, per workload, "
        "proposer, draft length and concurrency; checks every request's tokens against the plain run's",
        params=(
            Param("model", "path", None, "GGUF file (None: the embedded Gemma 3 270M)", optional=True),
            Param("workloads", "word_list", list(WORKLOADS), "prompt sets (data/workloads/, workbench/workloads.py; "
                  "a row's workload)", words=WORKLOADS),
            Param("proposers", "word_list", ["ngram", "suffix"], "draft proposers (SpecConfig.proposer, "
                  "spec.proposer_fields; a row's proposer)", words=("ngram", "suffix"),
                  pattern=r"self:[0-9]+|draft:.+", forms="'self:K' (the first K layers) or 'draft:PATH' (a GGUF)"),
            Param("ks", "int_list", [4], "most draft tokens a slot verifies per step (SpecConfig.k; a row's k)",
                  lo=1, hi=MAX_K),
            Param("concurrencies", "int_list", [1, 4, 16], "requests submitted together (a row's concurrency; "
                  "at most 32: the shipped sets hold 32 prompts)", lo=1, hi=32),
            Param("guards", "word_list", ["on"], "the yield guard on or off, or seed 002's cohort rule (SpecConfig.guard "
                  "True / False / 'cohort'; a row's guard)", words=GUARDS),
            Param("trees", "int_list", [0], "token-tree node budgets (SpecConfig.tree, more than k; 0: a linear "
                  "chain; a row's tree)", lo=0, hi=MAX_TREE),
            Param("pipelines", "int_list", [0], "the decoding slots from which the slots' halves verify in turn "
                  "(SpecConfig.pipeline; 0: off; n-gram and suffix chains; a row's pipeline; each row names its own, "
                  "where the engine's default is 'auto': 8 on the GPU; an arm starting above a row's concurrency "
                  "is left out where its pipeline=0 twin runs)", lo=0, hi=1 << 16),
            Param("temperatures_pct", "int_list", [0], "sampling temperatures in hundredths (0: greedy; 80: "
                  "temperature 0.8, top-p 0.95, seeded; a row's temperature)", lo=0, hi=200),
            Param("max_tokens", "int", None, "a cap on each prompt's own max_tokens (None: the prompt's)", lo=1,
                  optional=True),
            Param("backend", "word", "torch", "the engine's backend ('torch': the CPU path, 'triton': the GPU's)",
                  words=BACKENDS),
            Param("seed", "int", 0, "0: the shipped prompt sets; else generated with this seed", lo=0, hi=2**63 - 1),
            Param("timed_passes", "int", 1, "timed passes per engine after its warm-up, each of an arm's right "
                  "after one of AR's (a round); a row reports the pass of median goodput and the median of the "
                  "rounds' ratios (3 on a GPU: a shape first met in a pass captures a graph inside it)", lo=1, hi=9),
        ),
        # Quick: the embedded model on a CPU, two workloads at two concurrencies, short outputs
        quick={"workloads": ["code-edit", "essay"], "proposers": ["ngram"], "ks": [4], "concurrencies": [1, 2],
               "guards": ["on"], "max_tokens": 24},
    )


def _qsa_boundary() -> Ablation:
    from workbench.engine_config import MAX_CONCURRENCY
    from workbench.qsa import MAX_KEPT, MAX_TOP_K, QSAConfig, SUMMARIES

    default = QSAConfig()
    return Ablation(
        name="qsa-boundary",
        notebook="qsa_boundary.ipynb",
        description="QSA sparse attention against dense on each side of its boundary: KL, top-1 agreement, "
        "needle retrieval and where outputs diverge, decode throughput per concurrency; checks bitwise "
        "dense below the boundary and batched equal to solo above it",
        params=(
            Param("model", "path", None, "GGUF file (None: the embedded Gemma 3 270M)", optional=True),
            Param("context_lens", "int_list", [1024, 2048, 4096, 8192, 16384, 32512],
                  "prompt tokens (a row's context_len; the real model's context is 32,768)", lo=16),
            Param("top_ks", "int_list", [default.top_k], "blocks each row keeps by score (QSAConfig.top_k; a row's "
                  "top_k)", lo=1, hi=MAX_TOP_K),
            Param("blocks", "int_list", [default.block], "positions per indexer block (QSAConfig.block, a divisor "
                  "of 256; a row's block)", lo=1, hi=256),
            Param("sink_blocks", "int", default.sink_blocks, "first blocks always kept (QSAConfig.sink_blocks)",
                  lo=0, hi=MAX_KEPT),
            Param("local_blocks", "int", default.local_blocks, "last blocks always kept, the row's own among them "
                  "(QSAConfig.local_blocks)", lo=1, hi=MAX_KEPT),
            Param("summary", "word", default.summary, "block summary: 'mean' (MoBA) or 'minmax' (Quest)",
                  words=SUMMARIES),
            Param("concurrencies", "int_list", [1, 4, 16], "requests submitted together in the speed runs (a "
                  "row's concurrency)", lo=1, hi=MAX_CONCURRENCY),
            Param("depths_pct", "int_list", [10, 50, 90], "where the needle stands in the prompt, in percent",
                  lo=0, hi=100),
            Param("gen_tokens", "int", 16, "tokens each request generates", lo=1, hi=65536),
            Param("backend", "word", "torch", "the engine's backend (QSA runs on both)",
                  words=("torch", "triton")),
            Param("seed", "int", 0, "seeds the prompts", lo=0, hi=2**63 - 1),
        ),
        # Quick: the embedded model on a CPU; boundaries of 72 and 200 positions, so that the
        # 128-token prompts are past one and below the other (a dense-equality row, flagged)
        quick={"context_lens": [128, 320], "top_ks": [16, 48], "blocks": [4], "concurrencies": [1, 2],
               "depths_pct": [25, 75], "gen_tokens": 10},
    )


def registry() -> dict[str, Ablation]:
    """Every ablation, by name."""
    return {a.name: a for a in (_chunk_sizing(), _paging_cliff(), _draft_yield(), _qsa_boundary())}


def get(name: str) -> Ablation:
    found = registry()
    if name not in found:
        raise WorkbenchError(f"unknown ablation {name!r}; ablations: {', '.join(found)}")
    return found[name]


def validate(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Every parameter of ablation `name`, defaults filled in, each checked; refuses unknown
    names and bad values with a WorkbenchError naming the parameter and what it allows.

    The runner's parameters (`RUNNER_PARAMS`: data_dir, run_id, progress) pass through,
    defaulting to "data", None and True.
    """
    ablation = get(name)
    known = [p.name for p in ablation.params]
    unknown = [k for k in params if k not in known and k not in RUNNER_PARAMS]
    if unknown:
        raise WorkbenchError(
            f"{name}: unknown parameter(s) {', '.join(map(repr, unknown))}; parameters: {', '.join(known)}"
        )
    config = {p.name: p.check(params.get(p.name, p.default)) for p in ablation.params}
    data_dir = params.get("data_dir", "data")
    run_id = params.get("run_id")
    if not isinstance(data_dir, (str, Path)) or not str(data_dir):
        raise WorkbenchError(f"data_dir={data_dir!r} is not allowed: allowed a folder path")
    if run_id is not None and not isinstance(run_id, str):
        raise WorkbenchError(f"run_id={run_id!r} is not allowed: allowed a run id (text) or None")
    if run_id is not None and run_id.strip().lower() in ("none", "null"):  # papermill -r passes text
        run_id = None
    progress = _flag("progress", params.get("progress", True))
    return config | {"data_dir": str(data_dir), "run_id": run_id, "progress": progress}


def describe(name: str) -> str:
    """The ablation, its parameters with defaults and allowed values, and its quick overrides."""
    a = get(name)
    lines = [f"{a.name}: {a.description}", f"  notebook: notebooks/{a.notebook}"]
    lines += [f"  {p.describe()}" for p in a.params]
    lines.append("  --quick: " + ", ".join(f"{k}={v!r}" for k, v in a.quick.items()))
    return "\n".join(lines)


def parse_overrides(name: str, pairs: Sequence[str]) -> dict[str, Any]:
    """`-p name=value` pairs into values (see `Param.parse`); refuses unknown and runner params."""
    ablation = get(name)
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise WorkbenchError(f"-p {pair!r} is not name=value; parameters: "
                                 f"{', '.join(p.name for p in ablation.params)}")
        if key in RUNNER_PARAMS:
            raise WorkbenchError(f"-p {key}: set by the runner, not a parameter "
                                 "(use --data-dir for the run store, --no-progress for no progress bars)")
        out[key] = ablation.param(key).parse(text)
    return out


# ---- sweeps ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    """One independent run: an ablation's notebook with validated parameters, into a run store.

    Holds only plain data (picklable, JSON-able), so that any executor can ship it elsewhere.
    """

    ablation: str
    notebook: str  # absolute path of the notebook to execute
    params: Mapping[str, Any]  # validated, every parameter; without the runner's parameters
    data_dir: str  # absolute path of the run store's root
    index: int = 0  # position in its sweep
    swept: Mapping[str, Any] = field(default_factory=dict)  # the values that differ across the sweep
    quick: bool = False  # planned with the ablation's quick overrides (recorded in the manifest)

    @property
    def label(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.swept.items())
        return f"{self.ablation} {extra}".strip()


@dataclass(frozen=True)
class RunResult:
    spec: RunSpec
    run_id: str
    status: str  # "complete" | "failed"
    run_dir: Path
    notebook_path: Path  # the executed notebook, beside the tables
    tables: tuple[str, ...]
    wall_s: float
    error: str | None = None


def plan_sweep(name: str, params: Mapping[str, Any] | None = None, *, quick: bool = False,
               data_dir: str | Path = "data") -> list[RunSpec]:
    """The runs of a sweep, every one validated before any runs.

    `params` override the quick overrides (`quick=True`), which override the defaults. A
    scalar parameter given a list of values is an axis: one RunSpec per combination of axes.
    Every spec carries `quick`, and its params hold every parameter (defaults filled in).
    """
    ablation = get(name)
    params = dict(params or {})
    for key in RUNNER_PARAMS:
        if key in params:
            raise WorkbenchError(f"{key} is set by the runner, not a parameter (use data_dir= / --data-dir)")
    merged = {**(ablation.quick if quick else {}), **params}
    axes = {k: list(v) for k, v in merged.items()
            if isinstance(v, (list, tuple)) and not ablation.param(k).is_list}
    for k, values in axes.items():
        if not values:
            raise WorkbenchError(f"{k}: a sweep needs at least one value: allowed {ablation.param(k).allowed()}")
    if not ablation.notebook_path.is_file():
        raise WorkbenchError(f"notebook {ablation.notebook_path} of {name} is missing")
    root = str(Path(data_dir).resolve())
    specs = []
    for index, combo in enumerate(itertools.product(*axes.values())):
        swept = dict(zip(axes, combo))
        config = validate(name, {**merged, **swept})
        user = {k: v for k, v in config.items() if k not in RUNNER_PARAMS}
        if user.get("model") is not None:
            user["model"] = str(Path(user["model"]).resolve())
        specs.append(RunSpec(name, str(ablation.notebook_path), user, root, index, swept, quick))
    return specs


# ---- executors ------------------------------------------------------------------------------


class Executor(Protocol):
    def run(self, specs: Sequence[RunSpec]) -> list[RunResult]: ...


class LocalExecutor:
    """Runs the specs one after another in this process's Python, each in its own kernel.

    A run that fails is recorded as failed and the next one still runs. With `progress_bar`,
    papermill's bar over the cells and the notebook's own bars (its `progress` parameter,
    written to the kernel's stderr, which comes through to this process's stderr).

    A Ray executor would map each `RunSpec` to one task, since specs are independent and hold
    plain data::

        execute = ray.remote(num_cpus=1, num_gpus=1)(execute_run)   # one GPU per run
        refs = [execute.options(name=spec.label).remote(spec, progress_bar=False) for spec in specs]
        results = ray.get(refs)                                      # in spec order

    `spec.data_dir` must then be storage that every worker and the driver see (a shared file
    system), or each task writes to a node-local store and returns its run folder for the
    driver to copy into its own store; run ids are unique per run, so folders never collide.
    Each worker needs the workbench installed and the model file at the same path (or
    `params["model"] = None`, the embedded default, which every install carries).
    """

    def __init__(self, *, progress_bar: bool = True, log_output: bool = False,
                 on_start: Callable[[RunSpec, int, int], None] | None = None,
                 on_finish: Callable[[RunResult, int, int], None] | None = None):
        self.progress_bar = progress_bar
        self.log_output = log_output
        self.on_start = on_start
        self.on_finish = on_finish

    def run(self, specs: Sequence[RunSpec]) -> list[RunResult]:
        results = []
        for i, spec in enumerate(specs):
            if self.on_start is not None:
                self.on_start(spec, i, len(specs))
            results.append(execute_run(spec, progress_bar=self.progress_bar, log_output=self.log_output))
            if self.on_finish is not None:
                self.on_finish(results[-1], i, len(specs))
        return results


def execute_run(spec: RunSpec, *, progress_bar: bool = True, log_output: bool = False) -> RunResult:
    """Run one spec: start a run in the store, execute the notebook into the run's folder
    through papermill, then end the run complete (or failed, with the error line).

    With `progress_bar`, papermill shows its bar over the cells and the notebook its own bars
    (`progress`), whose text lines come through the kernel's stderr to this process's stderr.
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError

    from workbench.runstore import RunStore

    started = time.perf_counter()
    run = RunStore(spec.data_dir).start_run(spec.ablation, dict(spec.params), quick=spec.quick)
    notebook_out = run.path / Path(spec.notebook).name
    error = None
    try:
        papermill.execute_notebook(
            spec.notebook,
            str(notebook_out),
            parameters={**spec.params, "data_dir": spec.data_dir, "run_id": run.run_id, "progress": progress_bar},
            kernel_name=KERNEL_NAME,
            language="python",
            progress_bar=progress_bar,
            log_output=log_output,
            stderr_file=sys.stderr if progress_bar and not log_output else None,
            kernel_manager_class=this_python_kernel_manager(),
        )
    except PapermillExecutionError as exc:  # a cell raised
        error = f"{exc.ename}: {_first_line(exc.evalue)} (cell {exc.exec_count})"
    except Exception as exc:  # the kernel died, timed out, or did not start
        error = f"{type(exc).__name__}: {_first_line(str(exc))}"
    except BaseException as exc:  # interrupted: record it, then stop
        _end(spec.data_dir, run.run_id, "failed", f"{type(exc).__name__}: {_first_line(str(exc))}")
        raise
    run = attach_run(spec.data_dir, run.run_id)
    if error is None and not run.manifest["tables"]:
        error = "the notebook wrote no tables"
    status = "complete" if error is None else "failed"
    run.finish(status, error=error)
    return RunResult(spec, run.run_id, status, run.path, notebook_out, tuple(run.manifest["tables"]),
                     time.perf_counter() - started, error)


def _end(data_dir: str, run_id: str, status: str, error: str | None) -> None:
    run = attach_run(data_dir, run_id)
    if run.status == "running":
        run.finish(status, error=error)


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def this_python_kernel_manager() -> type:
    """A kernel manager whose kernel is this interpreter's ipykernel.

    Papermill looks "python3" up among the installed kernel specs, where a user-level spec
    may point at another Python; pinning the command to `sys.executable` makes the notebook
    run in the same environment as the runner, installed or fresh.
    """
    import zmq
    from ipykernel.kernelspec import RESOURCES, get_kernel_dict
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import AsyncKernelManager

    class ThisPythonKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            # Encrypt the local kernel's sockets where this jupyter_client and libzmq can
            # (the kernel warns on stderr otherwise).
            if self.has_trait("transport_encryption") and zmq.has("curve"):
                self.transport_encryption = "auto"

        @property
        def kernel_spec(self) -> KernelSpec:
            return KernelSpec(resource_dir=RESOURCES, **get_kernel_dict())  # argv[0] = sys.executable

    return ThisPythonKernelManager


# ---- the run a notebook writes into ---------------------------------------------------------


def attach_run(data_dir: str | Path, run_id: str):
    """The `Run` of a run started elsewhere (the runner), read back from its manifest."""
    from workbench.runstore import MANIFEST, Run, RunStore

    path = RunStore(data_dir).runs_dir / run_id
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WorkbenchError(f"run {run_id!r} has no readable manifest under {path}: {exc}") from None
    return Run(path, manifest)


@contextmanager
def recording(config: Mapping[str, Any], ablation: str) -> Iterator[Any]:
    """The run a notebook writes its tables into.

    With `config["run_id"]` set (the runner's run), that run, which the runner ends. Without
    (the notebook run by hand), a new run in `config["data_dir"]`, ended here: complete, or
    failed if the block raises; it is recorded as quick when its parameters hold every quick
    override's value (`Ablation.is_quick`), since nothing else says how it was planned.
    """
    if config.get("run_id"):
        run = attach_run(config["data_dir"], config["run_id"])
        if run.status != "running" or run.manifest["ablation"] != ablation:
            raise WorkbenchError(f"run {run.run_id} is {run.status} {run.manifest['ablation']!r}, "
                                 f"not a running {ablation!r} run")
        yield run
        return
    from workbench.runstore import RunStore

    params = {k: v for k, v in config.items() if k not in RUNNER_PARAMS}
    quick = get(ablation).is_quick(params)
    with RunStore(config["data_dir"]).start_run(ablation, params, quick=quick) as run:
        yield run


def measurement_bar(labels: Sequence[str], *, enabled: bool = True):
    """A tqdm bar with one step per label, described by the first (a no-op one when not
    `enabled`); `next_measurement` counts a step done and names the next.

    `tqdm.auto`'s widget where a Jupyter server started the kernel (JupyterLab: the browser
    draws it); text on stderr everywhere else. Under papermill the widget would leave only its
    first frame (0%) in the log and the executed notebook, since later frames travel as widget
    messages, not outputs; the text bar's updates are stderr output, which papermill's
    --log-output prints and the executed notebook keeps. A Jupyter server marks the kernels it
    starts with JPY_SESSION_NAME (ipykernel reads it for `__session__`); papermill does not.
    """
    if "JPY_SESSION_NAME" in os.environ:
        from tqdm.auto import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm(total=len(labels), desc=labels[0] if labels else None, disable=not enabled, file=sys.stderr,
                unit="measurement")


def next_measurement(bar, labels: Sequence[str]) -> None:
    """Count one measurement done and describe the bar by the next one, in a single refresh:
    the bar names what runs now, and a log gets one line per measurement."""
    if bar.n + 1 < len(labels):
        bar.set_description(labels[bar.n + 1], refresh=False)
    bar.update()


def run_rows(run, table: str = SUMMARY_TABLE):
    """The rows `run` has written to `table` so far, as the store tags them."""
    from workbench.runstore import RunStore

    return RunStore(run.path.parent.parent).load(table, run_status=None, run_id=run.run_id)


# ---- chunk sizing ---------------------------------------------------------------------------


def prompt_ids(model, length: int, key: str) -> list[int]:
    """`length` token ids of seeded random text (the same for the same key and model)."""
    from workbench.synthetic import WORDS

    rng = random.Random(key)
    ids: list[int] = []
    while len(ids) < length:
        text = " ".join(rng.choice(WORDS) for _ in range(max(8, length)))
        ids += model.tokenize(text, add_bos=not ids)
    return ids[:length]


def measure_chunk_sizing(
    model,
    *,
    concurrency: int,
    prompt_lens: Sequence[int],
    chunk_sizes: Sequence[int | str],
    chunk_cap: int,
    gen_tokens: int,
    decode_prompt_len: int,
    repeats: int,
    seed: int,
    progress: bool = True,
):
    """One row per (prompt length, repeat, chunk size): a long prompt arrives while the other
    `concurrency - 1` slots are decoding. With `progress`, a bar with one step per measurement
    (`measurement_bar`), described by the measurement it is on.

    The decoding slots generate long enough to keep decoding through the whole prefill at the
    smallest chunk size. Measured: TTFT (the long prompt's, and the worst), the inter-token
    latency the decoding slots see while the long prompt prefills (max, p99; and their p50
    over the whole run), aggregate throughput (generated tokens / wall), and memory: the
    process's peak RSS (`peak_memory_bytes`: weights included, and it never shrinks within a
    process, so a small chunk measured after a large one inherits its peak), the peak KV
    bytes, and the activation bytes of the largest prefill step by the runner's own per-row
    figure (`prefill_activation_bytes`, the part that scales with the chunk).
    Evidence: the chunk size the planner used and why, the steps that mixed decode rows with
    prefill rows, and each row's token ids hashed, with `outputs_identical` against the first
    chunk size of the same prompt length.
    """
    import polars as pl

    from workbench.engine import Engine
    from workbench.engine_config import EngineConfig
    from workbench.telemetry import percentile

    fixed = [c for c in chunk_sizes if c != "auto"]
    smallest = min(fixed + [chunk_cap])
    context = model.config.context_length
    _warm_up(model, EngineConfig(max_concurrency=concurrency, dtype=model.dtype_name))
    rows = []
    labels = [f"prompt_len={prompt_len} chunk={chunk} repeat={repeat + 1}/{repeats}"
              for prompt_len in prompt_lens for repeat in range(repeats) for chunk in chunk_sizes]
    with measurement_bar(labels, enabled=progress) as bar:
        for prompt_len in prompt_lens:
            decode_tokens = gen_tokens + math.ceil(prompt_len / smallest) + 1
            if prompt_len + gen_tokens > context or decode_prompt_len + decode_tokens > context:
                raise WorkbenchError(
                    f"prompt_len={prompt_len} with gen_tokens={gen_tokens} (decoding slots: {decode_prompt_len} + "
                    f"{decode_tokens}) does not fit the model's context of {context} tokens"
                )
            short = [prompt_ids(model, decode_prompt_len, f"{seed}-decode-{i}") for i in range(concurrency - 1)]
            long = prompt_ids(model, prompt_len, f"{seed}-long-{prompt_len}")
            reference = None
            for repeat in range(repeats):
                for chunk in chunk_sizes:
                    config = EngineConfig(max_concurrency=concurrency,
                                          chunk_size=None if chunk == "auto" else chunk,
                                          chunk_cap=chunk_cap, dtype=model.dtype_name)
                    row, outputs = _long_prompt_arrives(Engine(model, config), short, long, decode_tokens,
                                                        gen_tokens, percentile)
                    reference = outputs if reference is None else reference
                    rows.append({
                        "prompt_len": prompt_len,
                        "chunk_setting": str(chunk),
                        "repeat": repeat,
                        **row,
                        "decode_prompt_len": decode_prompt_len,
                        "decode_slot_tokens": decode_tokens,
                        "outputs_identical": outputs == reference,
                        "tokens_sha256": hashlib.sha256(json.dumps(outputs).encode()).hexdigest(),
                        "model_name": str(model.source.get("general.name", model.path.stem)),
                        "model_sha256": model.source.index.sha256,
                    })
                    next_measurement(bar, labels)
    return pl.DataFrame(rows, infer_schema_length=None)


def _warm_up(model, config) -> None:
    """One tiny generation, so that the first measurement does not pay one-off start-up costs."""
    from workbench.engine import Engine

    Engine(model, config).generate([prompt_ids(model, 8, "warm-up")], max_tokens=2, ignore_eos=True)


def _long_prompt_arrives(engine, short, long, decode_tokens, gen_tokens, percentile):
    """Start the short prompts, step until each has its first token (they now decode), then
    submit the long prompt and run to the end."""
    start = time.perf_counter()
    decoding = [engine.submit(p, max_tokens=decode_tokens, ignore_eos=True, request_id=f"decode-{i}")
                for i, p in enumerate(short)]
    for handle in decoding:
        next(iter(handle.tokens()))
    first_step = len(engine.telemetry.step_records)
    arriving = engine.submit(long, max_tokens=gen_tokens, ignore_eos=True, request_id="long")
    engine.run_until_done()
    wall = time.perf_counter() - start
    results = [h.result() for h in decoding] + [arriving.result()]
    slow = arriving.result()
    stall = [
        b - a
        for r in results[:-1]
        for a, b in zip(r.token_times, r.token_times[1:])
        if slow.submitted_at < b <= slow.first_token_at
    ]
    every_gap = [g for r in results[:-1] for g in r.inter_token_s]
    after = engine.telemetry.steps()[first_step:]
    prefill = after.filter(after["prefill_rows"] > 0)
    generated = sum(r.num_generated_tokens for r in results)
    row = {
        "chunk_size": int(prefill["chunk_size"].max()),
        "chunk_reason": prefill["chunk_reason"][0],
        "max_prefill_rows": int(prefill["prefill_rows"].max()),
        "num_prefill_steps": prefill.height,
        "num_mixed_steps": int((prefill["decode_rows"] > 0).sum()),
        "ttft_s": slow.ttft_s,
        "ttft_s_max": max(r.ttft_s for r in results),
        "itl_s_max": max(stall) if stall else None,
        "itl_s_p99": percentile(stall, 99),
        "itl_s_p50": percentile(every_gap, 50),
        "num_stall_gaps": len(stall),
        "generated_tokens": generated,
        "wall_s": wall,
        "decode_tok_s_aggregate": generated / wall,
        "peak_memory_bytes": engine.peak_memory_bytes,
        "peak_kv_bytes": engine.telemetry.peak_kv_bytes,
        "prefill_activation_bytes": int(prefill["prefill_rows"].max()) * engine.runner.bytes_per_prefill_row,
    }
    return row, [r.token_ids for r in results]


def require_identical(summary) -> None:
    """Raise (failing the run) unless every row's outputs equal its reference chunk size's."""
    bad = summary.filter(~summary["outputs_identical"])
    if bad.height:
        cases = ", ".join(f"prompt_len={r['prompt_len']} chunk={r['chunk_setting']} repeat={r['repeat']}"
                          for r in bad.head(5).iter_rows(named=True))
        raise WorkbenchError(f"outputs differ across chunk sizes in {bad.height} measurement(s): {cases}")


def chunk_sizing_charts(rows) -> list:
    """The dashboard's chunk-sizing views over tagged summary rows (as the store holds them)."""
    from workbench import dashboard

    return dashboard.ablation_charts("chunk-sizing", rows)
