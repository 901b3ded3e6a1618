"""The real model against two peers no one here wrote: Hugging Face transformers (fp32, the GGUF
dequantized) and llama.cpp (which quantizes activations). Teacher-forced logits, not greedy
strings: peers disagree on near-ties. Goldens come from scripts/goldens_*.py."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

GOLDENS = Path(__file__).parent / "goldens"
pytestmark = pytest.mark.real_model


def _load(peer):
    g = np.load(GOLDENS / f"logits_{peer}.npz")
    n = len(json.loads((GOLDENS / "prompts.json").read_text())["prompts"])
    return [
        {k: g[f"p{i}_{k}"] for k in ("ids", "topk_ids", "topk_vals", "last_full")}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def ours_f32(real_model_f32):
    return {peer: [real_model_f32.logits(p["ids"].tolist()) for p in _load(peer)] for peer in ("transformers",)}


def _agreement(ref_ids, ref_vals, ours, min_margin):
    margin = ref_vals[:, 0] - ref_vals[:, 1]
    keep = margin > min_margin
    ref_top1 = torch.from_numpy(ref_ids[:, 0].astype(np.int64))
    agree = ours.argmax(-1) == ref_top1
    return int(agree[torch.from_numpy(keep)].sum()), int(keep.sum())


def test_prompts_cover_the_sliding_window():
    prompts = json.loads((GOLDENS / "prompts.json").read_text())["prompts"]
    assert len(prompts) >= 8
    assert max(p["n_tokens"] for p in prompts) > 512


def test_float32_path_matches_transformers(real_model_f32, ours_f32):
    worst, agree, total = 0.0, 0, 0
    for ref, ours in zip(_load("transformers"), ours_f32["transformers"]):
        assert real_model_f32.tokenize  # same ids as the goldens (tokenizer tested separately)
        ids = torch.from_numpy(ref["topk_ids"].astype(np.int64))
        got = torch.gather(ours, 1, ids)
        worst = max(worst, (got - torch.from_numpy(ref["topk_vals"])).abs().max().item())
        worst = max(worst, (ours[-1] - torch.from_numpy(ref["last_full"])).abs().max().item())
        a, t = _agreement(ref["topk_ids"], ref["topk_vals"], ours, 0.5)
        agree, total = agree + a, total + t
    print(f"\nfp32 vs transformers: max |logit error| = {worst:.2e}; top-1 agreement {agree}/{total} (margin > 0.5)")
    assert worst < 5e-3
    assert agree / total >= 0.995


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_llamacpp_where_its_margin_exceeds_one(dtype, real_model_f32, real_model_bf16):
    m = real_model_f32 if dtype == "float32" else real_model_bf16
    agree, total = 0, 0
    for ref in _load("llamacpp"):
        ours = m.logits(ref["ids"].tolist())
        a, t = _agreement(ref["topk_ids"], ref["topk_vals"], ours, 1.0)
        agree, total = agree + a, total + t
    print(f"\n{dtype} vs llama.cpp: top-1 agreement {agree}/{total} where llama.cpp's margin > 1")
    assert total > 100
    assert agree == total


def test_bfloat16_path_close_to_transformers(real_model_bf16):
    agree, total = 0, 0
    for ref in _load("transformers"):
        ours = real_model_bf16.logits(ref["ids"].tolist())
        a, t = _agreement(ref["topk_ids"], ref["topk_vals"], ours, 1.0)
        agree, total = agree + a, total + t
    assert agree / total >= 0.99
