"""Sampling parameters and the one logits-processing function every decode path uses.

``processed_logprobs`` turns raw logits into the log-probabilities of the distribution a
token is actually drawn from (temperature, then top-k, then top-p, renormalised).
Plain decoding samples from it; speculative decoding (accept/reject) compares the
target's and the drafter's processed distributions produced by this same function, so
both paths see the same distribution by construction.

All randomness is counter-based: every random number is a pure function (a 32-bit
hash, MurmurHash3's finaliser in int64 tensor arithmetic, exact on every device) of the
request's key (its request seed: ``own_seed``), a counter and an index. No generator
state: a batch's draws are one tensor computation whatever its rows (no loop over
rows), capturable in a CUDA graph, the same on every TP rank and independent of which
other requests share the batch.

Standard sampling (``rollout.sampling_mode=standard``) draws from per-request streams
(``stream_salts``): the salt of a draw is hash(key, t0, tag), with t0 the row's
response position at the start of the step (``len(tokens)``: the token the step
emits first) and ``tag`` what the draw is for; the index is the token id (a Gumbel
row, ``stream_gumbel``) or a slot (``stream_exponential``). Allocation:

- a plain step (and the prefill's first token) at t0: one Gumbel row, ``STREAM_SAMPLE``;
- a speculative step at t0: the chain draft at depth j, one Gumbel row over the draft
  vocabulary, ``STREAM_DRAFT + j``; the acceptance tests, one exponential per chain
  depth j or tree node id, ``STREAM_ACCEPT`` (slot = j or the node id, each tried at
  most once); the step's last token (the residual after a rejection, the bonus, or a
  tree's fallback), one Gumbel row, ``STREAM_FINAL``.

Every step of a row emits at least one token, so t0 strictly grows from step to step
and no two draws of a row share a (t0, tag, index): the draws are independent (up to
the hash: distinct salts of one request coincide with probability ~n^2 / 2^33 for n
salts, the same 32-bit salts as coupled noise). The consumption is fixed per step and
depends only on host-known integers (t0, the strategy's depth and tree size). A
request's plain-step token at t0 depends on its key and its logits only; a
speculative step draws differently (the same distribution, another realisation), so
a response depends on which steps speculated (the tuner's decisions), as with any
exact speculative sampler.

Coupled sampling (``rollout.sampling_mode=coupled``) draws token t of a request as
argmax_v(log p~[v] + g[v]) (the Gumbel-max form of sampling from p~) with the noise
g = -log(-log U) and U a counter-based hash of (request key, t, v): no generator state,
nothing that depends on the batch row, the batch size, speculation, the TP size or the
device. ``coupled_gumbel`` makes the noise; speculative decoding drafts and verifies
with the same noise (``speculative.py``), so its output is the plain coupled sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

LOGPROB_MODES = ("raw", "tempered", "processed")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: 0 means greedy (argmax of the raw logits); otherwise logits are divided
        by it before top-k/top-p.
    top_k: keep the k most likely tokens (0 = off). Ties at the k-th value are kept.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p
        (1.0 = off). The most likely token is always kept.
    max_new_tokens: generation stops after this many tokens (finish_reason "length").
    stop_token_ids: extra tokens that end a sequence (finish_reason "stop"); the
        engine's EOS ids always stop unless ``ignore_eos``. The stop token is included
        in the output.
    ignore_eos: do not stop on EOS (benchmarks that need exact lengths).
    seed: makes sampling reproducible; None draws a fresh seed per call.
    logprobs: which log-probability of each sampled token is returned:
        "raw" (default) = log_softmax of the model's logits, no temperature or
        truncation;
        "tempered" = log_softmax(logits / temperature), no top-k/top-p truncation:
        what the RL trainer's forward computes (training log-probs are taken at the
        sampling temperature, top-k/top-p shape only the sampling);
        "processed" = under the distribution the token was sampled from.
        Greedy requests (temperature 0) return the raw log-prob in every mode.
    return_hidden_states: also return the target's final hidden state (after the final
        norm, i.e. the LM head's input) at the position that produced each token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: Optional[int] = None
    logprobs: str = "raw"
    return_hidden_states: bool = False

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs not in LOGPROB_MODES:
            raise ValueError(f"logprobs must be one of {LOGPROB_MODES}, got {self.logprobs!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def processing_key(self) -> tuple:
        """Rows with equal keys share one logits-processing call."""
        return (self.temperature, self.top_k, self.top_p)


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                       top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the sampling distribution, [..., vocab], float32.

    temperature 0 (greedy) returns the raw log-softmax; the greedy token is its argmax.
    Removed tokens get -inf. ``logits`` is not modified.
    """
    x = logits.float()
    if temperature > 0.0 and temperature != 1.0:
        x = x / temperature
    if temperature > 0.0 and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if temperature > 0.0 and top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the first token has mass_before 0: kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def requested_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                       params: Sequence[SamplingParams], raw: torch.Tensor,
                       processed: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` [rows, vocab], the log-prob of ``tokens[r]`` that
    ``params[r].logprobs`` asks for, [rows] float32. ``raw`` and ``processed`` [rows]
    are ``choose_tokens``' (or the speculative verifier's) log-probs of the same tokens;
    "tempered" rows are computed here, one call per temperature (at temperature 1 it
    is the raw log-prob; without top-k / top-p, the processed one)."""
    def untruncated_tempered(p: SamplingParams) -> bool:
        return (p.logprobs == "tempered" and not p.greedy and p.temperature != 1.0
                and p.top_k == 0 and p.top_p == 1.0)

    out = torch.where(torch.tensor([(p.logprobs == "processed" and not p.greedy)
                                    or untruncated_tempered(p) for p in params],
                                   device=raw.device), processed, raw)
    by_t: dict[float, list[int]] = {}
    for r, p in enumerate(params):
        if p.logprobs != "tempered" or p.greedy or p.temperature == 1.0:
            continue  # raw
        if not untruncated_tempered(p):
            by_t.setdefault(p.temperature, []).append(r)
    for t, idx in by_t.items():
        index = torch.tensor(idx, device=logits.device)
        lps = processed_logprobs(logits.index_select(0, index), t)
        out[index] = lps.gather(-1, tokens.index_select(0, index)[:, None])[:, 0].to(out.dtype)
    return out


def request_seed(seed: int, index: int) -> int:
    """Request ``index``'s own seed under call seed ``seed``: the key of its random
    stream (standard sampling, ``stream_salts``) or of its coupled noise."""
    return (int(seed) * 1_000_003 + int(index)) % (2**63 - 1)


def own_seed(seed: Optional[int], index: int,
             request_seeds: Optional[Sequence[int]] = None) -> int:
    """Request ``index``'s seed: the caller's ``request_seeds[index]`` when given, else
    ``request_seed(seed, index)``."""
    if request_seeds is not None:
        return int(request_seeds[index]) % (2**63 - 1)
    return request_seed(seed, index)


# ----------------------------------------------------------------- coupled sampling noise
_M32 = 0xFFFFFFFF


def _fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser (a bijection with full avalanche), Python ints."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _fmix32_t(h: torch.Tensor) -> torch.Tensor:
    """``_fmix32`` elementwise on int64 tensors holding 32-bit values (products wrap
    modulo 2**64 and are masked back to their low 32 bits: exact on every device)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _salts(keys: Sequence[int], positions: Sequence[int]) -> list[int]:
    """One 32-bit salt per (key, position): the 64-bit key and the position each pass
    through the finaliser, so nearby keys and positions give unrelated salts."""
    out = []
    for k, t in zip(keys, positions):
        k = int(k) & ((1 << 64) - 1)
        a = _fmix32((k & _M32) ^ 0x243F6A88)
        a = _fmix32(a ^ ((k >> 32) & _M32) ^ 0x85A308D3)
        out.append(_fmix32(a ^ ((int(t) * 0x9E3779B9 + 0x13198A2E) & _M32)))
    return out


_TOKEN_HASH: dict[tuple[int, str], torch.Tensor] = {}


def _token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """fmix32 of each token id (salted), [vocab] int64, made once per vocab and device."""
    key = (vocab, str(device))
    t = _TOKEN_HASH.get(key)
    if t is None:
        ids = torch.arange(vocab, dtype=torch.int64, device=device)
        t = _fmix32_t((ids * 0x9E3779B1 + 0x7F4A7C15) & _M32)
        _TOKEN_HASH[key] = t
    return t


def coupled_gumbel(keys: Sequence[int], positions: Sequence[int], vocab: int,
                   device, token_ids: Optional[torch.Tensor] = None,
                   kernels=None) -> torch.Tensor:
    """Gumbel noise g[i, v] for (keys[i], positions[i], v), [n, vocab] float32
    (``token_ids``: only those tokens' columns, [n, len(token_ids)]).

    h is a 32-bit hash of (key, position, token id) computed in integers, U = (h + 1/2)
    / 2**32, E = -log U and g = -log E, in float32: for U >= 1/2, E = -log1p(-V) with
    V = 1 - U taken from the hash's distance to 2**32 (integers, exact), so the small
    E where g is large and decides rare tokens keep their precision. Gumbel-max:
    argmax(log p + g) is distributed as p. The same values on every batch layout and TP
    size; on every device and through the CPU kernels (``kernels``: their
    ``coupled_gumbel``, one pass without temporaries, several times faster) up to a
    few ulp of a float32 log (a near-tie, like the logits' own device differences)."""
    device = torch.device(device)
    table = _token_hash(vocab, device)
    if token_ids is not None:
        table = table[token_ids]
    if not len(keys):
        return torch.zeros(0, table.shape[0], dtype=torch.float32, device=device)
    salt = torch.tensor(_salts(keys, positions), dtype=torch.int64, device=device)
    if kernels is not None and device.type == "cpu":
        return kernels.coupled_gumbel(salt, table)
    return gumbel_of_hash(_fmix32_t(table[None, :] ^ salt[:, None]))


def gumbel_of_hash(h: torch.Tensor) -> torch.Tensor:
    """g = -log(-log U) of 32-bit hashes ``h`` (int64), U = (h + 1/2) / 2**32, float32
    (``coupled_gumbel``; the CPU kernels compute the same steps)."""
    return -torch.log(exponential_of_hash(h))


def exponential_of_hash(h: torch.Tensor) -> torch.Tensor:
    """E = -log U > 0 of 32-bit hashes ``h`` (int64), U = (h + 1/2) / 2**32, float32: an
    Exp(1) draw, exact at both ends (U < 1/2: -log of U; U >= 1/2: -log1p(-V) with
    V = 1 - U from the hash in integers, so the small E of U near 1 keep their
    precision; U never rounds to 0 or 1)."""
    lo = h < 2**31
    t = torch.where(lo, h, _M32 - h)  # the distance to the nearer end, < 2**31
    w0 = (t.float() + 0.5) * (1.0 / 4294967296.0)
    w = torch.where(lo, w0, 1.0 - w0)  # U, or 1 - V rounded
    log_w = torch.log(w)
    # log1p(-V) = -V log(w) / (w - 1) for w = 1 - V rounded; w == 1: -V
    hi_e = torch.where(w == 1.0, w0, w0 * log_w / (w - 1.0))
    return torch.where(lo, -log_w, hi_e)


class CoupledNoise:
    """Full-vocabulary coupled noise rows (``coupled_gumbel``) by (key, position), each
    computed once while it is kept: a speculative step's drafting and its verification
    need the same positions' noise (drafting L+1..L+d, verification L+1..L+d+1), so the
    step computes d+1 rows instead of 2d+1. ``clear`` at the start of every step."""

    def __init__(self, vocab: int, device, kernels=None):
        self.vocab, self.device = vocab, torch.device(device)
        self.kernels = kernels  # the CPU kernels' coupled_gumbel when given
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def clear(self) -> None:
        self._rows.clear()

    def rows(self, keys: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """[n, vocab] float32, equal to ``coupled_gumbel(keys, positions, vocab, device,
        kernels=self.kernels)``."""
        pairs = [(int(k), int(t)) for k, t in zip(keys, positions)]
        missing = list(dict.fromkeys(p for p in pairs if p not in self._rows))
        if missing:
            g = coupled_gumbel([k for k, _ in missing], [t for _, t in missing], self.vocab,
                               self.device, kernels=self.kernels)
            self._rows.update(zip(missing, g.unbind(0)))
        if not pairs:
            return torch.zeros(0, self.vocab, dtype=torch.float32, device=self.device)
        return torch.stack([self._rows[p] for p in pairs])


def coupled_argmax(logprobs: torch.Tensor, keys: Sequence[int], positions: Sequence[int],
                   kernels=None) -> torch.Tensor:
    """The coupled token of each row of ``logprobs`` [rows, vocab] (processed
    log-probabilities; -inf for tokens top-k / top-p removed)."""
    g = coupled_gumbel(keys, positions, logprobs.shape[-1], logprobs.device, kernels=kernels)
    return argmax_rows(logprobs.float() + g, kernels)


# ------------------------------------------------------- standard sampling's streams
STREAM_SAMPLE = 1  # a plain step's token (one Gumbel row)
STREAM_ACCEPT = 2  # a speculative step's acceptance tests (one exponential per slot)
STREAM_FINAL = 3  # a speculative step's last token (one Gumbel row)
STREAM_DRAFT = 16  # + j: a speculative step's chain draft at depth j (one Gumbel row)


def stream_salts(keys: torch.Tensor, positions: torch.Tensor, tags) -> torch.Tensor:
    """32-bit salts of standard sampling's draws (module docstring), int64 on the keys'
    device: ``keys`` [n] (request seeds, 0 <= key < 2**63), ``positions`` [n] (each
    row's t0), ``tags`` an int or a [T] tensor (then [n, T]). Device arithmetic only:
    no host read, a fixed number of operations for any n."""
    k = keys.to(torch.int64)
    a = _fmix32_t((k & _M32) ^ 0x243F6A88)
    a = _fmix32_t(a ^ ((k >> 32) & _M32) ^ 0x85A308D3)
    base = _fmix32_t(a ^ ((positions.to(torch.int64) * 0x9E3779B9 + 0x13198A2E) & _M32))
    if isinstance(tags, torch.Tensor):
        base, tags = base[:, None], tags.to(device=base.device, dtype=torch.int64)
    return _fmix32_t(base ^ ((tags * 0x632BE5AB + 0x3C6EF372) & _M32))


def stream_salts_of(keys: Sequence[int], positions: Sequence[int], tags,
                    device) -> torch.Tensor:
    """``stream_salts`` of host integers (one host-to-device copy)."""
    kp = torch.tensor([[int(k), int(t)] for k, t in zip(keys, positions)],
                      dtype=torch.int64, device=device).view(-1, 2)
    return stream_salts(kp[:, 0], kp[:, 1], tags)


def stream_gumbel(salt: torch.Tensor, vocab: int, kernels=None) -> torch.Tensor:
    """Gumbel rows g[i, v] of salts ``salt`` [n] over indices 0..vocab-1, [n, vocab]
    float32: the coupled noise's hash and logs (``coupled_gumbel``), through the CPU
    kernels' one-pass form when given on the CPU."""
    table = _token_hash(vocab, salt.device)
    if kernels is not None and salt.device.type == "cpu":
        return kernels.coupled_gumbel(salt.contiguous(), table)
    return gumbel_of_hash(_fmix32_t(table[None, :] ^ salt[:, None]))


def stream_exponential(salt: torch.Tensor, slots: int) -> torch.Tensor:
    """Exp(1) draws E[..., j] = -log U of salts ``salt`` [...] at slots 0..slots-1,
    [..., slots] float32 (U < x  <=>  E > -log x: acceptance tests in log space)."""
    table = _token_hash(max(slots, 1), salt.device)[:slots]
    return exponential_of_hash(_fmix32_t(table ^ salt[..., None]))


def sample_rows(logprobs: torch.Tensor, salt: torch.Tensor, kernels=None) -> torch.Tensor:
    """One token per row of ``logprobs`` [rows, vocab] (processed; -inf for removed
    tokens), each row from its own stream (``salt`` [rows]): the Gumbel-max form
    argmax(log p + g), an exact draw from p, all rows at once."""
    g = stream_gumbel(salt, logprobs.shape[-1], kernels)
    return argmax_rows(logprobs.float() + g, kernels)


def argmax_rows(x: torch.Tensor, kernels=None) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of 2-D ``x`` (the first of equal maxima; a NaN counts
    as the largest), through the fused CPU kernels (``cpu_kernels.argmax_rows``) when
    given and x is float32 on the CPU (and their policy allows it at this row count):
    torch's CPU argmax takes ~0.5 ms for 8 rows of a 49k vocabulary, the kernel's
    vectorised scan a few microseconds per row."""
    if (kernels is not None and x.dim() == 2 and x.device.type == "cpu"
            and x.dtype == torch.float32 and x.shape[-1] > 0 and x.stride(-1) == 1
            and (getattr(kernels, "policy", None) is None
                 or kernels.policy.allows("argmax", x.shape[0]))):
        return kernels.argmax_rows(x, x.shape[-1])
    return torch.argmax(x, dim=-1)


def choose_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  streams: Sequence[Optional[tuple[int, int]]], kernels=None,
                  coupled: Optional[Sequence[Optional[tuple[int, int]]]] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick the next token for each row of ``logits`` [rows, vocab].

    Returns (tokens [rows] long, raw log-prob [rows], processed log-prob [rows]).
    Rows are grouped by their processing key so a uniform batch costs one call.
    ``kernels``: the fused CPU kernels, for greedy rows' argmax (``argmax_rows``) and
    the noise rows. ``streams``: per row, (request key, position in the response) of
    standard sampling's stream (``sample_rows`` with ``STREAM_SAMPLE``; None for
    greedy and coupled rows). ``coupled``: per row, (request key, position in the
    response) for coupled sampling (``coupled_argmax``) or None.
    """
    rows = logits.shape[0]
    if all(p.greedy for p in params):  # the common benchmark / eval case: no grouping
        x = logits.float()
        tokens = argmax_rows(x, kernels)
        raw_lp = x.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
        return tokens, raw_lp, raw_lp
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    processed = torch.empty(rows, dtype=torch.float32, device=logits.device)
    raw = torch.log_softmax(logits.float(), dim=-1)
    groups: dict[tuple, list[int]] = {}
    for r, p in enumerate(params):
        groups.setdefault(p.processing_key(), []).append(r)
    for key, idx in groups.items():
        temperature, top_k, top_p = key
        index = torch.tensor(idx, device=logits.device)
        if temperature == 0.0:
            tok = argmax_rows(raw.index_select(0, index), kernels)
            lp = raw.index_select(0, index).gather(-1, tok[:, None])[:, 0]
        else:
            lps = processed_logprobs(logits.index_select(0, index), temperature, top_k, top_p)
            if coupled is not None and all(coupled[r] is not None for r in idx):
                tok = coupled_argmax(lps, [coupled[r][0] for r in idx],
                                     [coupled[r][1] for r in idx], kernels)
            elif coupled is not None and any(coupled[r] is not None for r in idx):
                raise ValueError("coupled and standard sampled rows share a setting; "
                                 "one sampling mode per call")
            else:
                salt = stream_salts_of([streams[r][0] for r in idx],
                                       [streams[r][1] for r in idx], STREAM_SAMPLE,
                                       logits.device)
                tok = sample_rows(lps, salt, kernels)
            lp = lps.gather(-1, tok[:, None])[:, 0]
        tokens[index] = tok
        processed[index] = lp
    raw_lp = raw.gather(-1, tokens[:, None])[:, 0]
    return tokens, raw_lp, processed
