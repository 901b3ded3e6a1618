"""The QSA-boundary ablation (issue 22, item 4): what sparse attention costs in quality and buys
in speed on each side of its boundary, and proof in every row that it is exact where it claims.

For every context length, block size and top_k (sink and local blocks fixed per run), the
quality side runs once on needle prompts (workbench/compression_quality.py's: a 6-digit code
bound to a name, planted at each of `depths`, asked for at the end):

* teacher-forced logits dense and with QSA over two windows of the prompt: the 32 rows either
  side of the boundary (`boundary_window`) and the prompt's last 128 rows (the longest
  contexts, `tail_window`); `dense_equal_below` says every row below the boundary is bitwise
  dense, `first_diff_position` the first row that is not (the boundary itself, where the prompt
  passes it); `kl_mean` (KL(dense || QSA), nats) and `top1_agreement` over the rows past it;
* a greedy continuation of `gen_tokens` dense and with QSA: `prefix_match` (leading tokens
  equal) and needle retrieval (`needle_dense`, `needle_qsa`: the share of depths whose code the
  continuation states).

The speed side, per concurrency: that many requests of the context length, each generating
`gen_tokens`, submitted together on a dense engine and on a QSA engine: aggregate and
per-sequence decode throughput, `qsa_vs_dense`; and `batched_equals_solo`: every request of the
QSA run bitwise (tokens and logits) its own QSA run alone.

Activation: `qsa_sparse_rows` counts the row-layers that attended sparsely in the QSA speed run.
A row whose contexts never pass the boundary ran dense by design: it is flagged
(`activation_ok` False, `activation_flag` saying so), kept for its dense-equality check, never
reported as a sparse measurement; so is a row past the boundary whose engine attended no row
sparsely.

The full sizes (1K-32K contexts, 16 slots) are the H200's; the CPU runs `--quick`. The torch
path loops over sparse rows in Python (sparse_attention.py), so on the CPU QSA is slower than
dense: its speed columns there say what the reference costs, not what the mechanism buys.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

from workbench.errors import WorkbenchError

BOUNDARY_WINDOW = 32  # rows either side of the boundary compared dense vs QSA
TAIL_WINDOW = 128  # the prompt's last rows compared


def measure_qsa_boundary(
    model,
    *,
    context_lens: Sequence[int],
    top_ks: Sequence[int],
    blocks: Sequence[int],
    concurrencies: Sequence[int],
    depths: Sequence[float],
    gen_tokens: int,
    sink_blocks: int = 1,
    local_blocks: int = 1,
    summary: str = "mean",
    backend: str = "torch",
    seed: int = 0,
    progress: bool = True,
):
    """One row per (context length, block, top_k, concurrency): the module docstring's columns."""
    import polars as pl

    from workbench.ablations import measurement_bar, next_measurement, prompt_ids
    from workbench.qsa import QSAConfig

    context = model.config.context_length
    for n in context_lens:
        if n + gen_tokens > context:
            raise WorkbenchError(f"context_len={n} with gen_tokens={gen_tokens} does not fit the model's context of "
                                 f"{context} tokens: allowed context_len <= {context - gen_tokens}")
    configs = [QSAConfig(block=b, top_k=k, sink_blocks=sink_blocks, local_blocks=local_blocks, summary=summary)
               for b in blocks for k in top_ks]
    for cfg in configs:
        cfg.resolve_layers(model.config)  # (a model without full-attention layers: one line, before any run)
    labels = [f"context={n} block={c.block} top_k={c.top_k} " + (f"C={cc}" if cc else "quality")
              for n in context_lens for c in configs for cc in [None, *concurrencies]]
    rows = []
    dense_speed: dict = {}  # (context, concurrency) -> the dense engine's run, shared by every QSA config
    with measurement_bar(labels, enabled=progress) as bar:
        for n in context_lens:
            for cfg in configs:
                quality = _quality(model, cfg, n, depths, gen_tokens, seed)
                next_measurement(bar, labels)
                for c in concurrencies:
                    prompts = [prompt_ids(model, n, f"{seed}-qsa-{n}-{i}") for i in range(c)]
                    if (n, c) not in dense_speed:
                        dense_speed[n, c] = _run(model, _config(model, c, n, gen_tokens, None, backend), prompts,
                                                 gen_tokens)
                    got = _run(model, _config(model, c, n, gen_tokens, cfg, backend), prompts, gen_tokens)
                    solo_same = True
                    if c > 1:
                        solo_config = _config(model, 1, n, gen_tokens, cfg, backend)
                        for p, r in zip(prompts, got["results"]):
                            s = _run(model, solo_config, [p], gen_tokens)["results"][0]
                            solo_same &= s.token_ids == r.token_ids and _equal(s.logits, r.logits)
                    rows.append(_row(model, cfg, n, c, gen_tokens, backend, quality, got, dense_speed[n, c],
                                     solo_same))
                    next_measurement(bar, labels)
    return pl.DataFrame(rows, infer_schema_length=None)


def measure_from_config(model, config: dict):
    """`measure_qsa_boundary` with a validated config (`ablations.validate("qsa-boundary", ...)`)."""
    return measure_qsa_boundary(
        model, context_lens=config["context_lens"], top_ks=config["top_ks"], blocks=config["blocks"],
        concurrencies=config["concurrencies"], depths=[d / 100 for d in config["depths_pct"]],
        gen_tokens=config["gen_tokens"], sink_blocks=config["sink_blocks"], local_blocks=config["local_blocks"],
        summary=config["summary"], backend=config["backend"], seed=config["seed"], progress=config["progress"])


def _config(model, concurrency: int, context_len: int, gen_tokens: int, qsa, backend: str):
    from workbench.engine_config import EngineConfig

    page = model.state_layout.page_size
    per_request = -(-(context_len + gen_tokens + 1) // page) * page
    return EngineConfig(max_concurrency=concurrency, dtype=model.dtype_name, backend=backend, qsa=qsa,
                        kv_resident_tokens=concurrency * per_request, admission_headroom_tokens=0)


def _equal(a, b) -> bool:
    import torch

    return a is not None and b is not None and torch.equal(a, b)


def window_logits(model, ids: Sequence[int], windows: Sequence[tuple[int, int]], qsa=None):
    """Teacher-forced float32 logits of the prompt rows in `windows` ([lo, hi) pairs, ascending,
    disjoint), stacked; the other rows run without the output head (a 32K-row prompt's logits
    would take 34 GB)."""
    import torch

    from workbench.model import Segment

    ids = list(ids)
    state = model.new_state(len(ids), qsa)
    want = torch.zeros(len(ids), dtype=torch.bool)
    for lo, hi in windows:
        want[lo:hi] = True
    out = []
    with torch.inference_mode():
        s = 0
        while s < len(ids):
            e = min(len(ids), s + 512)
            # a chunk is cut where `want` changes, so each part is all rows or none
            e = next((i for i in range(s + 1, e) if want[i] != want[s]), e)
            lg = model.forward([Segment(state, ids[s:e], "all" if want[s] else "none")])[0]
            if lg is not None:
                out.append(lg)
            s = e
    return torch.cat(out) if out else torch.empty(0, model.config.vocab_size)


def _quality(model, cfg, n: int, depths: Sequence[float], gen_tokens: int, seed: int) -> dict:
    import torch

    from workbench.compression_quality import needle_prompt
    from workbench.engine import Engine

    b = cfg.dense_positions
    kl, agree, equal_below, first_diff, matches, found_dense, found_qsa = [], [], True, None, [], [], []
    for i, depth in enumerate(depths):
        needle = needle_prompt(model, n, depth, seed=seed + i)
        ids = list(needle.ids)
        L = len(ids)
        wins = _windows(L, b)
        rows = torch.cat([torch.arange(lo, hi) for lo, hi in wins])
        dense, sparse = window_logits(model, ids, wins), window_logits(model, ids, wins, cfg)
        same = (dense == sparse).all(-1)
        equal_below &= bool(same[rows < b].all())
        diff = rows[~same]
        if len(diff):
            first_diff = int(diff[0]) if first_diff is None else min(first_diff, int(diff[0]))
        past = rows >= b
        if past.any():
            p, q = dense[past].double().log_softmax(-1), sparse[past].double().log_softmax(-1)
            kl.append(float((p.exp() * (p - q)).sum(-1).mean()))
            agree.append(float((p.argmax(-1) == q.argmax(-1)).double().mean()))
        gens = {}
        for name, qsa in (("dense", None), ("qsa", cfg)):
            e = Engine(model, _config(model, 1, L, gen_tokens, qsa, "torch"))
            gens[name] = e.generate([ids], max_tokens=gen_tokens, ignore_eos=True)[0]
        m = 0
        for x, y in zip(gens["dense"].token_ids, gens["qsa"].token_ids):
            if x != y:
                break
            m += 1
        matches.append(m)
        found_dense.append(needle.code in gens["dense"].text)
        found_qsa.append(needle.code in gens["qsa"].text)
    mean = (lambda v: sum(v) / len(v) if v else None)
    return {"dense_equal_below": equal_below, "first_diff_position": first_diff, "kl_mean": mean(kl),
            "top1_agreement": mean(agree), "prefix_match": mean(matches), "needle_dense": mean(found_dense),
            "needle_qsa": mean(found_qsa), "num_depths": len(depths)}


def _windows(length: int, boundary: int) -> list[tuple[int, int]]:
    a = (max(0, boundary - BOUNDARY_WINDOW), min(length, boundary + BOUNDARY_WINDOW))
    if a[1] <= a[0]:  # the prompt ends before the boundary's window
        return [(max(0, length - TAIL_WINDOW), length)]
    t = (max(a[1], length - TAIL_WINDOW), length)
    return [a, t] if t[1] > t[0] else [a]


def _run(model, config, prompts, gen_tokens: int) -> dict:
    from workbench.engine import Engine

    engine = Engine(model, config, keep_logits=True)
    start = time.perf_counter()
    handles = [engine.submit(p, max_tokens=gen_tokens, ignore_eos=True, request_id=f"qsa-{i}")
               for i, p in enumerate(prompts)]
    engine.run_until_done()
    wall = time.perf_counter() - start
    results = [h.result() for h in handles]
    first = min(r.first_token_at for r in results)
    last = max(r.finished_at for r in results)
    decoded = sum(len(r.token_ids) - 1 for r in results)
    steps = engine.telemetry.steps()
    sparse = int(steps["qsa_sparse_rows"].sum()) if config.qsa is not None else None
    per = [r.decode_tok_s for r in results if r.decode_tok_s]
    return {"results": results, "wall_s": wall,
            "decode_tok_s_aggregate": decoded / (last - first) if last > first else None,
            "decode_tok_s_per_stream": sum(per) / len(per) if per else None,
            "qsa_sparse_rows": sparse,
            "qsa_blocks_kept": int(steps["qsa_blocks_kept"].sum()) if config.qsa is not None else None,
            "qsa_blocks_scored": int(steps["qsa_blocks_scored"].sum()) if config.qsa is not None else None}


def _row(model, cfg, n: int, c: int, gen_tokens: int, backend: str, quality: dict, got: dict, dense: dict,
         solo_same: bool) -> dict:
    ok, flag = activation(context_len=n, gen_tokens=gen_tokens, boundary=cfg.dense_positions,
                          sparse_rows=got["qsa_sparse_rows"] or 0)
    tokens_same = [a.token_ids == b.token_ids for a, b in zip(got["results"], dense["results"])]
    agg, dagg = got["decode_tok_s_aggregate"], dense["decode_tok_s_aggregate"]
    return {
        "context_len": n, "block": cfg.block, "top_k": cfg.top_k, "sink_blocks": cfg.sink_blocks,
        "local_blocks": cfg.local_blocks, "summary": cfg.summary, "concurrency": c, "gen_tokens": gen_tokens,
        "backend": backend, "boundary": cfg.dense_positions, "past_boundary": n + gen_tokens > cfg.dense_positions,
        "arm": (arm := f"top_k {cfg.top_k} x block {cfg.block} ({cfg.summary}; boundary {cfg.dense_positions})"),
        "arm_concurrency": f"{arm} · C={c}",
        **quality,
        "decode_tok_s_aggregate": agg, "decode_tok_s_per_stream": got["decode_tok_s_per_stream"],
        "dense_decode_tok_s_aggregate": dagg, "dense_decode_tok_s_per_stream": dense["decode_tok_s_per_stream"],
        "qsa_vs_dense": agg / dagg if agg and dagg else None,
        "wall_s": got["wall_s"], "dense_wall_s": dense["wall_s"],
        "qsa_sparse_rows": got["qsa_sparse_rows"], "qsa_blocks_scored": got["qsa_blocks_scored"],
        "qsa_blocks_kept": got["qsa_blocks_kept"],
        "tokens_equal_dense": all(tokens_same),
        "batched_equals_solo": solo_same,
        "activation_ok": ok, "activation_flag": flag,
        "tokens_sha256": hashlib.sha256(json.dumps([r.token_ids for r in got["results"]]).encode()).hexdigest(),
        "model_name": str(model.source.get("general.name", model.path.stem)),
        "model_sha256": model.source.index.sha256,
    }


def activation(*, context_len: int, gen_tokens: int, boundary: int, sparse_rows: int) -> tuple[bool, str | None]:
    """Whether the row measured sparse attention, and if not, what showed none (one line)."""
    if context_len + gen_tokens <= boundary:
        return False, (f"contexts of {context_len + gen_tokens} positions never pass the boundary of {boundary}: "
                       "every row was dense by design (a dense-equality row, not a sparse measurement)")
    if sparse_rows == 0:
        return False, f"contexts pass the boundary of {boundary} but no row attended sparsely"
    return True, None


def not_exact(summary) -> str | None:
    """One line naming the rows whose exactness claims failed (dense below the boundary, batched
    equal to solo); None when every row holds them."""
    bad = summary.filter(~summary["dense_equal_below"] | ~summary["batched_equals_solo"])
    if not bad.height:
        return None
    cases = ", ".join(f"context={r['context_len']} {r['arm']} C={r['concurrency']}" for r in bad.head(5).iter_rows(named=True))
    return f"exactness fails in {bad.height} row(s): {cases}"


def require_exact(summary) -> None:
    line = not_exact(summary)
    if line:
        raise WorkbenchError(line)


def flagged(summary):
    return summary.filter(~summary["activation_ok"])


def qsa_boundary_charts(rows, data_dir: str | Path = "data") -> list:
    """The dashboard's views of the ablation, then quality against context with the boundary of
    each arm marked (a rule at k * B, as the issue asks)."""
    from workbench import dashboard
    from workbench.dashboard.boundary import boundary_chart

    charts = dashboard.ablation_charts("qsa-boundary", rows)
    charts.append(boundary_chart(rows))
    return charts
