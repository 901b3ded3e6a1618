"""Kernel tests run natively on a CUDA GPU, else on the CPU under the Triton interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when it
decorates), hence at the top of this conftest, which pytest imports before the test modules.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from workbench.kernels.quant_tiles import QuantFormat  # noqa: E402

# Byte offsets of the f16 fields inside one block, per format (the rest may be any bytes).
_F16_FIELDS = {"Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_quant_rows(fmt: QuantFormat, n: int, k: int, seed: int, device) -> torch.Tensor:
    """uint8 [n, row_bytes] of random blocks: random quant bytes, f16 scales of +-[0.005, 0.02]."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = k // fmt.block_size
    raw = torch.randint(0, 256, (n, num_blocks, fmt.type_size), generator=gen, dtype=torch.uint8)
    for off in _F16_FIELDS[fmt.name]:
        mag = 0.005 + 0.015 * torch.rand(n, num_blocks, generator=gen)
        sign = torch.where(torch.rand(n, num_blocks, generator=gen) < 0.5, -1.0, 1.0)
        raw[:, :, off : off + 2] = (mag * sign).to(torch.float16).view(torch.uint8).reshape(n, num_blocks, 2)
    return raw.reshape(n, num_blocks * fmt.type_size).to(device)


@pytest.fixture
def quant_rows():
    return random_quant_rows
