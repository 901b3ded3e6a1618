"""StateLayout: page size validation, KV groups from a model config, bytes and live-page bounds."""

import subprocess
import sys

import pytest

from workbench.errors import WorkbenchError
from workbench.model_config import ModelConfig
from workbench.state import (
    DEFAULT_KEY_BLOCKS,
    DEFAULT_PAGE_SIZE,
    KVGroup,
    PagePayloadSpec,
    SeqStateSpec,
    StateLayout,
)


def gemma3_270m_config() -> ModelConfig:
    md = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 18,
        "gemma3.embedding_length": 640,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.feed_forward_length": 2048,
        "gemma3.context_length": 32768,
        "gemma3.attention.sliding_window": 512,
        "gemma3.vocab_size": 262144,
    }
    return ModelConfig.from_metadata(md, set())


def test_no_torch_import():
    code = (
        "import sys, workbench.state, workbench.state.allocator\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_default_key_blocks_are_the_kernels():
    from workbench.attention import KV_BLOCK
    from workbench.runners.triton_options import ATTN_SEGMENTS, TritonOptions

    assert DEFAULT_KEY_BLOCKS == (KV_BLOCK, TritonOptions().attn_segment)
    # every attention segment the Triton runner allows fits whole in a default page
    assert all(DEFAULT_PAGE_SIZE % kb == 0 for kb in (KV_BLOCK, *ATTN_SEGMENTS))
    StateLayout((KVGroup("g", (0,)),), key_blocks=(KV_BLOCK, *ATTN_SEGMENTS))


def test_gemma3_groups():
    layout = StateLayout.from_model_config(gemma3_270m_config(), kv_bytes_per_elem=2)
    assert layout.group_names == ("global", "sliding")
    g, s = layout.groups
    assert g.layers == (5, 11, 17) and g.window == 0
    assert len(s.layers) == 15 and s.window == 512 and s.sliding
    assert layout.group_of(11) is g and layout.group_of(0) is s
    per_layer = 2 * 1 * 256 * 2
    assert layout.page_bytes("global") == 3 * per_layer * 256
    assert layout.page_bytes("sliding") == 15 * per_layer * 256
    # long contexts: sliding layers keep 3 pages, so KV is about 3/18 of a contiguous cache
    n = 32768
    paged = sum(layout.page_bytes(x.name) * layout.max_live_pages(x.name, n) for x in layout.groups)
    contiguous = 18 * per_layer * n
    assert layout.max_live_pages("sliding", n) == 3
    assert paged * 18 == contiguous * 3 + 15 * per_layer * 768 * 18
    assert 3 / 18 < paged / contiguous < 3 / 18 + 0.02


def test_first_live_page_matches_the_attention_mask():
    # a query at q sees k with 0 <= q - k < window; page i is dead for q >= f iff its last
    # position (i + 1) * P - 1 < f - window + 1
    layout = StateLayout((KVGroup("s", (0,), 512),), page_size=256)
    for floor in range(0, 2000, 7):
        lo = layout.first_live_page("s", floor)
        first_visible = max(0, floor - 512 + 1)
        assert lo * 256 <= first_visible < (lo + 1) * 256
    assert layout.first_live_page("s", 767) == 1  # sees 256..767
    assert layout.first_live_page("s", 768) == 1  # sees 257..768: page 1 still needed
    assert layout.first_live_page("s", 1022) == 1  # sees 511..1022: position 511 is page 1's last
    assert layout.first_live_page("s", 1023) == 2  # sees 512..1023: page 1 is dead


@pytest.mark.parametrize("page_size", [0, -256, 128, 200, 320, True])
def test_bad_page_size(page_size):
    with pytest.raises(WorkbenchError, match="page_size"):
        StateLayout((KVGroup("g", (0,)),), page_size=page_size)


def test_page_size_multiple_of_lcm_of_key_blocks():
    layout = StateLayout((KVGroup("g", (0,)),), page_size=192, key_blocks=(64, 96))
    assert layout.page_size == 192
    with pytest.raises(WorkbenchError, match="allowed multiples of 192"):
        StateLayout((KVGroup("g", (0,)),), page_size=128, key_blocks=(64, 96))


def test_bad_groups_and_specs():
    with pytest.raises(WorkbenchError, match="names .* repeat"):
        StateLayout((KVGroup("g", (0,)), KVGroup("g", (1,))))
    with pytest.raises(WorkbenchError, match="layer is in two KV groups"):
        StateLayout((KVGroup("a", (0,)), KVGroup("b", (0,))))
    with pytest.raises(WorkbenchError, match="window=-1"):
        KVGroup("a", (0,), -1)
    with pytest.raises(WorkbenchError, match="names group 'x'"):
        StateLayout((KVGroup("a", (0,)),), page_payloads=(PagePayloadSpec("idx", "x", (2,)),))
    with pytest.raises(WorkbenchError, match="dtype='int4'"):
        SeqStateSpec("rec", (2, 3), "int4")
    with pytest.raises(WorkbenchError, match="unknown KV group 'nope': allowed a"):
        StateLayout((KVGroup("a", (0,)),)).group("nope")


def test_payloads_and_state_bytes():
    layout = StateLayout(
        (KVGroup("a", (0, 1), 0, bytes_per_position=100),),
        page_payloads=(PagePayloadSpec("minmax", "a", (2, 2, 4, 8), "float32"),),
        seq_state=(SeqStateSpec("recurrent", (2, 4, 8, 8)), SeqStateSpec("conv", (2, 64, 3), "bfloat16")),
    )
    assert layout.page_bytes("a") == 100 * 256 + 2 * 2 * 4 * 8 * 4
    assert layout.seq_state_bytes == 2 * 4 * 8 * 8 * 4 + 2 * 64 * 3 * 2


def test_max_live_pages_bound():
    layout = StateLayout((KVGroup("s", (0,), 512),), page_size=256)
    assert layout.max_live_pages("s", 100) == 1
    assert layout.max_live_pages("s", 10_000) == 3
    assert layout.max_live_pages("s", 10_000, chunk=2048) == 11
    assert layout.max_live_pages("s", 10_000, max_rollback=8) == 4
