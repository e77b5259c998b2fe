"""The drafter group's sizes left to the device (drafter_training/sizing.py): CPU keeps
the sizes the demo and the tests were tuned with; a CUDA device description (no GPU
needed) gives micro-steps of about MICRO_STEP_S within the loss's memory cap, enough of
them to fill a WINDOW_S window, and a buffer of BUFFER_BYTES."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_tlt.config import DrafterGroupConfig
from megatron_tlt.drafter_training import sizing
from megatron_tlt.drafter_training.sizing import DeviceInfo, DrafterCost, derive, resolve

GiB = 1 << 30
H100 = DeviceInfo("cuda", 80 * GiB, (9, 0))
H200 = DeviceInfo("cuda", 141 * GiB, (9, 0))
A100 = DeviceInfo("cuda", 80 * GiB, (8, 0))


def qwen_drafter(h: int, ffn: int, heads: int, kv_heads: int, vocab: int = 152064):
    """A one-layer drafter of a Qwen2.5 target: its layer (attention with GQA, SwiGLU
    MLP) plus fc (2h -> h), bf16 features."""
    d = h // heads
    layer = 2 * h * h + 2 * h * kv_heads * d + 3 * h * ffn + 2 * h * h
    return DrafterCost(hidden=h, vocab=vocab, layer_params=layer, feature_bytes=2)


QWEN_7B = qwen_drafter(3584, 18944, 28, 4)
QWEN_32B = qwen_drafter(5120, 27648, 40, 8)


def test_cpu_keeps_the_sizes_the_demo_and_tests_use():
    for cost in (QWEN_7B, DrafterCost(hidden=576, vocab=49152, layer_params=4_000_000)):
        got = derive(DeviceInfo("cpu"), cost)
        assert (got["batch_tokens"], got["max_steps_per_window"], got["buffer_tokens"]) \
            == (512, 32, 65536)


@pytest.mark.parametrize("device", [H100, H200, A100], ids=["h100", "h200", "a100"])
@pytest.mark.parametrize("cost", [QWEN_7B, QWEN_32B], ids=["7b", "32b"])
def test_a_cuda_device_gets_sizes_from_its_throughput_and_memory(device, cost):
    got = derive(device, cost, stop_checks=4)
    tokens, steps, rows = got["batch_tokens"], got["max_steps_per_window"], got["buffer_tokens"]
    cpu = sizing.CPU_SIZES
    assert tokens > cpu["batch_tokens"] and steps > cpu["max_steps_per_window"] \
        and rows > cpu["buffer_tokens"]
    # a micro-step: a multiple of 1024 tokens, at most MICRO_STEP_S at the modelled speed,
    # one chunk's vocabulary temporaries within the memory fraction
    assert tokens % sizing.TOKENS_STEP == 0
    assert sizing.TOKENS_MIN <= tokens <= sizing.TOKENS_MAX
    speed = sizing.ACHIEVED_FRACTION * device.peak_flops
    assert got["micro_step_s"] == pytest.approx(tokens * cost.flops_per_token / speed)
    assert got["micro_step_s"] <= sizing.MICRO_STEP_S
    chunk_bytes = tokens / 4 * sizing.LOSS_ROWS * 4 * cost.vocab
    assert chunk_bytes <= sizing.LOSS_MEMORY_FRACTION * device.total_memory
    # ... and not far below either bound (within one rounding step or the clamp)
    assert tokens + sizing.TOKENS_STEP > min(
        sizing.MICRO_STEP_S * speed / cost.flops_per_token,
        4 * sizing.LOSS_MEMORY_FRACTION * device.total_memory / (sizing.LOSS_ROWS * 4 * cost.vocab),
        sizing.TOKENS_MAX)
    # the step limit does not cut a WINDOW_S window short
    assert steps * got["micro_step_s"] >= sizing.WINDOW_S or steps == sizing.STEPS_MAX
    # the buffer: BUFFER_BYTES of host memory, rounded down to 65,536 rows
    row_bytes = cost.hidden * cost.feature_bytes
    assert rows % sizing.BUFFER_STEP == 0
    assert sizing.BUFFER_BYTES - sizing.BUFFER_STEP * row_bytes < rows * row_bytes \
        <= sizing.BUFFER_BYTES


def test_more_memory_or_a_faster_device_never_gets_smaller_micro_steps():
    for cost in (QWEN_7B, QWEN_32B):
        h100, h200, a100 = (derive(d, cost)["batch_tokens"] for d in (H100, H200, A100))
        assert a100 <= h100 <= h200
    assert derive(H100, QWEN_32B)["batch_tokens"] <= derive(H100, QWEN_7B)["batch_tokens"]


def test_resolve_fills_only_the_auto_sizes(tiny_llama):
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter

    _, arch = tiny_llama
    drafter = EagleDrafter(DrafterConfig.for_target(arch), arch)
    cost = DrafterCost.of(drafter)
    assert cost.layer_params == sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    assert (cost.hidden, cost.vocab, cost.feature_bytes) == (arch.hidden_size,
                                                              arch.vocab_size, 4)
    auto = DrafterGroupConfig()
    assert (auto.batch_tokens, auto.max_steps_per_window, auto.buffer_tokens) == (0, 0, 0)
    got = resolve(auto, drafter)  # a CPU drafter: the CPU sizes
    assert (got.batch_tokens, got.max_steps_per_window, got.buffer_tokens) == (512, 32, 65536)
    mixed = dataclasses.replace(auto, batch_tokens=24)
    assert resolve(mixed, drafter).batch_tokens == 24
    explicit = DrafterGroupConfig(batch_tokens=24, max_steps_per_window=3, buffer_tokens=100)
    assert resolve(explicit, drafter) is explicit
    assert DeviceInfo.of(torch.device("cpu")) == DeviceInfo("cpu")
