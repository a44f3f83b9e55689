"""How much work each section of ``bench core`` does, and the targets it reports against."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import KVSpec

GB = 1e9
MIB = 1 << 20
TARGET_RATIO = 0.7
TARGET_P99_MS = 1.0
TARGET_MAX_MS = 5.0
TARGET_HIT_US = 50.0
TARGET_GBPS = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreSizes:
    """How much work each section does: `FULL` for numbers, `QUICK` for smoke tests."""

    num_layers: int = 4
    """Layers of the KV spec; a layer is 8 KV heads x 128 x bf16 for K and for V (8B GQA)."""
    copy_tokens: int = 8192
    """Section 1: tokens in each pool; every run copies all of them (16 KiB each at 4 layers)."""
    page_sizes: tuple[int, ...] = (1, 16, 64)
    copy_reps: int = 5
    """Section 1: timed runs per case, each paired with a contiguous copy run back to back."""
    lag_seconds: float = 3.0
    """Section 2: how long the readers and writers run."""
    prompt_tokens: int = 256
    """Section 2: tokens per prompt (16 pages of 16)."""
    device_pages: int = 512
    host_pages: int = 2048
    readers: int = 8
    """Section 2: tasks that revisit old prompts (each revisit loads back from the host)."""
    writers: int = 8
    """Section 2: tasks that insert new prompts (each commit writes through to the host)."""
    hit_requests: int = 5000
    """Section 3: timed requests per prompt length and token type."""
    hit_prompt_tokens: tuple[int, ...] = (256, 4096)


FULL = CoreSizes()
QUICK = CoreSizes(copy_tokens=512, copy_reps=2, lag_seconds=0.3, prompt_tokens=64,
                  device_pages=64, host_pages=256, readers=2, writers=2, hit_requests=200,
                  hit_prompt_tokens=(64,))


def spec_of(num_layers: int) -> KVSpec:
    """The bench's KV spec: `num_layers` layers of 8 KV heads x 128 x bf16 (8B GQA)."""
    return KVSpec.mha(num_layers=num_layers, num_kv_heads=8, head_dim=128, dtype="bf16")
