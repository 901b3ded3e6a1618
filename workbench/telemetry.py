"""Telemetry as records: one per engine step, one per request, turned into polars frames.

The engine appends plain dicts to a `Telemetry` sink; nothing prints. The CLI, benchmarks and
notebooks summarise from `steps()` and `requests()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STEP_COLUMNS = (
    "step", "phase", "num_slots", "rows", "decode_rows", "prefill_rows", "num_forwards",
    "num_batched_groups", "num_solo", "solo_reasons", "decode_mode", "chunk_size", "chunk_reason",
    "policy", "fused", "wall_ms", "start_s", "kv_bytes", "rss_bytes",
    # paged runners (None otherwise): pages over all KV groups (per group too, e.g.
    # pages_used_global), what the step allocated and freed, prefix-hit tokens, preemptions
    "pages_used", "pages_free", "pages_cached", "pages_allocated", "pages_freed",
    "prefix_hit_tokens", "num_preemptions",
)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


@dataclass
class Telemetry:
    step_records: list[dict[str, Any]] = field(default_factory=list)
    request_records: list[dict[str, Any]] = field(default_factory=list)
    peak_rss_bytes: int = 0
    peak_kv_bytes: int = 0

    def record_step(self, rec: dict[str, Any]) -> None:
        self.step_records.append(rec)
        self.peak_rss_bytes = max(self.peak_rss_bytes, rec.get("rss_bytes") or 0)
        self.peak_kv_bytes = max(self.peak_kv_bytes, rec.get("kv_bytes") or 0)

    def record_request(self, rec: dict[str, Any]) -> None:
        self.request_records.append(rec)

    def steps(self):
        import polars as pl

        return pl.DataFrame(self.step_records, infer_schema_length=None) if self.step_records else pl.DataFrame(
            schema={c: pl.Null for c in STEP_COLUMNS}
        )

    def requests(self):
        import polars as pl

        return pl.DataFrame(self.request_records, infer_schema_length=None)

    def clear(self) -> None:
        self.step_records.clear()
        self.request_records.clear()
        self.peak_rss_bytes = 0
        self.peak_kv_bytes = 0
