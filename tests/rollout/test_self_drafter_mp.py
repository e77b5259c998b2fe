"""The self-drafter on two processes (tests/support/mp_self_drafter_worker.py): at TP=2
each rank quantizes its shards and speculation stays exact; two data-parallel replicas
re-quantize an updated policy bit-identically."""

from __future__ import annotations

import pytest

from cli import run_workers

pytestmark = pytest.mark.multiproc


def test_self_drafter_at_tp2_is_exact(tiny_hf_dirs, tmp_path):
    ranks = run_workers("tests/support/mp_self_drafter_worker.py", tmp_path / "out",
                        "--model", tiny_hf_dirs["llama_tied"], "--tp", 2, nproc=2)
    assert ranks[0] == ranks[1]  # the TP ranks agree on every token
    r = ranks[0]
    for case in ("chain", "tree", "chain_vocab"):
        assert r[case] == r["plain"], case  # greedy: plain decoding's tokens
        assert r[case + "/steps"] > 0 and r[case + "/shards"], case
    assert r["coupled_tree"] == r["coupled_plain"]


def test_replicas_refresh_bit_identically(tiny_hf_dirs, tmp_path):
    ranks = run_workers("tests/support/mp_self_drafter_worker.py", tmp_path / "out",
                        "--model", tiny_hf_dirs["llama_tied"], "--tp", 1, nproc=2)
    a, b = ranks
    assert a["before"] == b["before"] and a["after"] == b["after"]
    assert a["after"] != a["before"]  # the update was picked up ...
    assert a["refreshes"] == b["refreshes"] == 2  # ... by one re-quantization
    assert a["tokens"] == b["tokens"]
