"""What a ``generate`` call returns: one ``RolloutOutput`` per request and the call's
``GenerateStats``. Below the engine and every runner: the gathered runner builds the
other stages' outputs and merges their stats with these types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .speculative.stats import SpecStats


@dataclass
class RolloutOutput:
    """One generated sequence.

    token_ids: generated tokens (a final EOS/stop token included).
    logprobs: per generated token, its log-probability under the target model as the
        request's ``SamplingParams.logprobs`` asks: raw log_softmax of the logits
        (default), tempered (logits / temperature, no top-k/top-p) or processed (the
        distribution it was sampled from).
    finish_reason: "stop" (EOS or a stop token) or "length" (max_new_tokens or the
        context limit).
    hidden_states: [len(token_ids), hidden] on CPU when requested: row i is the
        target's final hidden state (after the final norm, the LM head's input) at the
        position whose logits produced token i, i.e. at the last prompt token for i=0
        and at generated token i-1 after that.
    routes: mixture-of-experts models: [len(prompt) + len(token_ids) - 1, MoE layers, k]
        int16 on CPU, the experts each position's token was routed to in each MoE layer
        (of the runner's layers, in order), for every position the engine ran: the
        prompt and every response token but the last (the positions whose logits give
        the response's tokens); None for dense models.
    """

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    hidden_states: Optional[torch.Tensor] = None
    routes: Optional[torch.Tensor] = None


@dataclass
class GenerateStats:
    """What the last ``generate`` call did (for logs and benchmarks)."""

    prompts: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens (padded) run through the model
    prefill_shared_rows: int = 0  # requests that copied another's prefill (share_prefill)
    decode_steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)  # running batch per decode step
    step_seconds: list[float] = field(default_factory=list)  # each decode step's time
    step_speculative: list[bool] = field(default_factory=list)  # ... whether it speculated
    kv_cache_bytes: int = 0
    # rollout.kv_cache=paged: rows preempted (blocks ran out; recomputed later), the
    # most rows in flight, the pool's blocks and the most in use, and their bytes
    preemptions: int = 0
    rows_peak: int = 0
    kv_blocks: int = 0
    kv_blocks_peak: int = 0
    kv_bytes_peak: int = 0
    pack_seconds: float = 0.0  # weights made ready (kernel panels; PP > 1 gathered: sync)
    spec: Optional[SpecStats] = None  # speculative decoding (None: no drafter attached)
    # rollout.cuda_graphs=auto: per measured key ("target/b4_t1_w0"), graph or eager and
    # the times that decided it (``cuda_graphs.GraphedDecoder.decisions``)
    graphs: dict = field(default_factory=dict)

    def record_step(self, seconds: float, speculative: bool) -> None:
        """Count one decode step (the running batch size is recorded before it runs)."""
        self.decode_steps += 1
        self.decode_seconds += seconds
        self.step_seconds.append(seconds)
        self.step_speculative.append(speculative)

    def note_blocks(self, used: int, rows: int, block_bytes: int = 0) -> None:
        """The paged cache before a decode step: blocks in use and rows in flight."""
        self.kv_blocks_peak = max(self.kv_blocks_peak, used)
        self.kv_bytes_peak = max(self.kv_bytes_peak, used * block_bytes)
        self.rows_peak = max(self.rows_peak, rows)

    @property
    def spec_fraction(self) -> float:
        """Fraction of decode steps that speculated."""
        return self.spec.steps / self.decode_steps if self.spec and self.decode_steps else 0.0

    def summary(self) -> dict:
        """JSON-able digest for logs and benchmarks."""
        out = {"prompts": self.prompts, "generated_tokens": self.generated_tokens,
               "prefill_tokens": self.prefill_tokens,
               "prefill_shared_rows": self.prefill_shared_rows,
               "decode_steps": self.decode_steps,
               "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds}
        if self.kv_blocks:
            out.update(preemptions=self.preemptions, rows_peak=self.rows_peak,
                       kv_blocks=self.kv_blocks, kv_blocks_peak=self.kv_blocks_peak,
                       kv_bytes_peak=self.kv_bytes_peak)
        if self.graphs:
            out["graphs"] = self.graphs
        if self.spec is not None:
            out["spec_fraction"] = self.spec_fraction
            out["spec"] = self.spec.summary()
        return out
