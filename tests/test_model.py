"""Forward pass on small random-weight GGUF models: chunk invariance, decode == prefill,
batched segments == solo (bitwise), and the loader's errors."""


import numpy as np
import pytest
import torch

from workbench.errors import WorkbenchError
from workbench.model import Segment, load_model

ARCHS = ["llama", "gemma3"]
DTYPES = ["float32", "bfloat16"]


def _ids(n, seed=0, vocab=390):
    g = torch.Generator().manual_seed(seed)
    return [2] + torch.randint(4, vocab, (n - 1,), generator=g).tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_is_bitwise_invariant(tiny_model, arch, dtype):
    m = tiny_model(arch, dtype)
    ids = _ids(150)  # crosses the tiny gemma3's 64-token sliding window
    whole = m.logits(ids, chunk=len(ids))
    assert whole.shape == (150, m.config.vocab_size) and torch.isfinite(whole).all()
    for chunk in (1, 7, 64):
        assert torch.equal(m.logits(ids, chunk=chunk), whole), f"chunk {chunk}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_segments_equal_solo(tiny_model, arch, dtype):
    m = tiny_model(arch, dtype)
    prompts = [_ids(n, seed=n) for n in (5, 40, 90, 1)]
    solo = []
    for p in prompts:
        st = m.new_state(200)
        rows = [m.forward([Segment(st, p, "last")])[0]]
        for t in range(6):
            rows.append(m.forward([Segment(st, [4 + t], "last")])[0])
        solo.append(torch.cat(rows))
    # all four together: prefill in one fused forward, then batched decode steps
    states = [m.new_state(200) for _ in prompts]
    out = m.forward([Segment(s, p, "last") for s, p in zip(states, prompts)])
    got = [[o] for o in out]
    for t in range(6):
        order = list(range(len(prompts)))[:: (-1) ** t]  # permute rows between steps
        out = m.forward([Segment(states[i], [4 + t], "last") for i in order])
        for i, o in zip(order, out):
            got[i].append(o)
    for i in range(len(prompts)):
        assert torch.equal(torch.cat(got[i]), solo[i]), f"sequence {i}"


def test_float32_and_bfloat16_agree_closely(tiny_model):
    ids = _ids(40)
    a = tiny_model("gemma3", "float32").logits(ids)
    b = tiny_model("gemma3", "bfloat16").logits(ids)
    assert (a - b).abs().max() < 0.25 * a.abs().max()


@pytest.mark.parametrize("weight_type", ["F32", "F16", "Q5_0", "Q4_0"])
def test_weight_types_load_and_run(tiny_model, weight_type):
    m = tiny_model("llama", "float32", weight_type)
    assert torch.isfinite(m.logits(_ids(10))).all()


def test_tokenize_detokenize(tiny_model):
    m = tiny_model("llama", "float32")
    ids = m.tokenize("the slot batch")
    assert ids[0] == m.tokenizer.bos_id
    assert m.detokenize(ids[1:]).strip() == "the slot batch"


def test_prompt_longer_than_context(tiny_model):
    m = tiny_model("llama", "float32", context_length=64)
    with pytest.raises(WorkbenchError, match="do not fit the context of 64"):
        m.logits(_ids(65))


def test_missing_file(tmp_path):
    with pytest.raises(WorkbenchError, match="not found"):
        load_model(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(WorkbenchError, match="not a GGUF file"):
        load_model(p)


def test_truncated_gguf(tiny_gguf, tmp_path):
    src = tiny_gguf("llama", "Q8_0").read_bytes()
    for cut in (len(src) // 2, 40):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(src[:cut])
        with pytest.raises(WorkbenchError, match="truncated|damaged"):
            load_model(p)


def _write(path, arch, tensors):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, data, raw_dtype in tensors:
        w.add_tensor(name, data, raw_dtype=raw_dtype) if raw_dtype else w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture(tmp_path):
    p = _write(tmp_path / "mamba.gguf", "mamba", [("x.weight", np.ones(32, np.float32), None)])
    with pytest.raises(WorkbenchError, match="architecture 'mamba' is not supported; supported: gemma3, llama"):
        load_model(p)


def test_unsupported_quant_type(q2k_gguf):
    with pytest.raises(WorkbenchError, match="quant type Q2_K, which is not supported; supported: .*Q4_K"):
        load_model(q2k_gguf)
