"""rollout.cpu_kernels=auto: the per-build calibration (megatron_tlt/rollout/kernel_policy.py)
is measured once, stored next to the build, read back, and the engine uses each kernel
family only at the batch sizes where it chose the kernels. No timing is asserted: the
decisions tested are written into the calibration file by the tests."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from megatron_tlt.config import RolloutConfig
from megatron_tlt.rollout import RolloutEngine, SamplingParams, cpu_kernels, kernel_policy
from megatron_tlt.rollout.kernel_policy import ALWAYS, FAMILIES, KernelPolicy
from tiny_models import VOCAB

TINY = dict(hidden=32, groups=2, heads_per_group=2, head_dim=16, ffn=48, vocab=500)


@pytest.fixture(scope="module")
def module():
    k = cpu_kernels.get()
    assert k is not None, "the CPU kernels did not build (needs a C++ compiler and ninja)"
    return k


@pytest.fixture
def calib(tmp_path, monkeypatch):
    """The calibration file lives in tmp_path (not next to the real build), no policy is
    pinned (conftest pins one for the other tests) and none is remembered yet."""
    path = tmp_path / "calibration-test.json"
    monkeypatch.setattr(kernel_policy, "calibration_path", lambda module: path)
    monkeypatch.setattr(kernel_policy, "pinned", None)
    monkeypatch.setattr(kernel_policy, "_policies", {})
    return path


def _record(use: dict, points=(1, 2, 4, 8, 16, 32, 64), **extra) -> dict:
    fams = {f: {"kernel_ms": [1.0] * len(points), "eager_ms": [1.0] * len(points),
                "speedup": [1.0] * len(points), "use": list(use.get(f, [False] * len(points)))}
            for f in FAMILIES}
    return dict(version=kernel_policy.VERSION, isa="test", cpu="test", threads=1,
                points=list(points), families=fams, **extra)


def test_policy_ranges():
    p = KernelPolicy(points=(1, 2, 4, 8, 16, 32, 64),
                     use={"decode": (True, True, True, True, False, True, True),
                          "linear": (False, True, True, True, True, True, True),
                          "argmax": (True,) * 7})
    assert [r for r in range(1, 65) if p.allows("decode", r)] == list(range(1, 9)) + list(
        range(32, 65))  # 9..15 lie between a yes (8) and a no (16): eager
    assert p.max_rows("decode") == 8
    assert p.ranges("decode") == [(1, 8), (32, 64)]
    assert p.max_rows("linear") == 0 and p.ranges("linear") == [(2, 64)]
    assert not p.allows("decode", 65) and not p.allows("argmax", 0)
    assert not p.allows("unknown", 1)
    assert p.describe() == "decode rows 1-8, 32-64; linear rows 2-64; argmax rows 1-64"
    none = KernelPolicy(points=(1, 64), use={f: (False, False) for f in FAMILIES})
    assert not none.any() and none.describe().count("none") == 3
    assert ALWAYS.max_rows("decode") == cpu_kernels.MAX_FUSED_ROWS


def test_calibration_record_is_complete(module):
    """A (tiny, one-round) calibration times every family at every point and stores its
    decision with the evidence; the record makes a policy."""
    rec = kernel_policy.calibrate(module, points=(1, 3), repeats=1, layers=1, context=8,
                                  shapes=TINY)
    assert rec["points"] == [1, 3] and rec["rounds"] == 1 and rec["isa"] == module.ISA
    for fam in FAMILIES:
        r = rec["families"][fam]
        assert len(r["kernel_ms"]) == len(r["eager_ms"]) == len(r["use"]) == 2
        assert all(t > 0 for t in r["kernel_ms"] + r["eager_ms"])
        for use, speedup in zip(r["use"], r["speedup"]):  # (speed-ups are rounded)
            if abs(speedup - 1 - rec["margin"]) > 1e-3:
                assert use == (speedup > 1 + rec["margin"])
    json.dumps(rec)
    policy = KernelPolicy.from_json(rec)
    assert policy.allows("argmax", 3) == rec["families"]["argmax"]["use"][1]


def test_calibration_runs_once_is_stored_and_logged_once(module, calib, monkeypatch, caplog,
                                                         capsys):
    calls = []

    def fake(mod, **kw):
        calls.append(1)
        return _record({"decode": [True] * 7, "linear": [True] * 7, "argmax": [True] * 7})
    monkeypatch.setattr(kernel_policy, "calibrate", fake)
    with caplog.at_level(logging.INFO, logger="megatron_tlt.rollout.kernel_policy"):
        p1 = kernel_policy.measured_policy(module)
        p2 = kernel_policy.measured_policy(module)
    assert p1 is p2 and len(calls) == 1
    assert json.loads(calib.read_text())["families"]["decode"]["use"] == [True] * 7
    said = [r.message for r in caplog.records if "CPU kernels" in r.message]
    assert len(said) == 1 and "decode rows 1-64" in said[0]
    assert "calibrating" in capsys.readouterr().err
    # a new process reads the stored decision without measuring
    monkeypatch.setattr(kernel_policy, "_policies", {})
    assert kernel_policy.measured_policy(module).use == p1.use and len(calls) == 1
    # a malformed or other-version file is measured again
    calib.write_text("{not json")
    monkeypatch.setattr(kernel_policy, "_policies", {})
    kernel_policy.measured_policy(module)
    assert len(calls) == 2


def test_busy_calibration_is_provisional(module, calib, monkeypatch):
    """Measured while other work loaded the cores: used, and replaced by the first
    engine that starts on an idle machine."""
    calib.write_text(json.dumps(_record({"argmax": [True] * 7}, busy=True)))
    monkeypatch.setattr(kernel_policy, "_load", lambda: 100.0)  # still busy: kept
    assert kernel_policy.measured_policy(module).allows("argmax", 5)
    monkeypatch.setattr(kernel_policy, "_policies", {})
    monkeypatch.setattr(kernel_policy, "_load", lambda: 0.0)  # idle now: measured again
    monkeypatch.setattr(kernel_policy, "calibrate", lambda mod, **kw: _record({}))
    assert not kernel_policy.measured_policy(module).any()
    assert "busy" not in json.loads(calib.read_text())


@pytest.fixture(scope="module")
def tiny_model(tiny_hf_dirs, single_process_parallel):
    from megatron_tlt.models import load_model
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return load_model(tiny_hf_dirs["qwen2"], device=torch.device("cpu"), dtype="float32")


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, VOCAB, (3 + i % 5,), generator=g).tolist() for i in range(n)]


def test_engine_honours_the_stored_decision(module, calib, tiny_model):
    """decode fused at 1-2 rows only, the LM head GEMM never, argmax everywhere: the
    engine calls exactly those kernels, and its tokens equal the eager engine's."""
    model, arch = tiny_model
    calib.write_text(json.dumps(_record({"decode": [True, True] + [False] * 5,
                                         "argmax": [True] * 7})))
    eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    assert eng.runner.kernels.policy.source == str(calib)
    assert eng.runner.fused_max_rows == 2
    calls: dict[str, list[int]] = {}
    real = eng.runner.kernels.module

    class Counting:  # count kernel calls (rows), pass everything through
        def __getattr__(self, name):
            fn = getattr(real, name)
            if not callable(fn):
                return fn

            def wrapped(*a, **kw):
                calls.setdefault(name, []).append(getattr(a[0], "shape", [0])[0] if a else 0)
                return fn(*a, **kw)
            return wrapped
    eng.runner.kernels.module = Counting()
    sp = SamplingParams(temperature=0.0, max_new_tokens=5)
    ref = RolloutEngine(model, None, RolloutConfig(cpu_kernels="false"), arch=arch,
                        eos_token_ids=[])
    assert ref.runner.kernels is None
    for n in (1, 2, 5):
        calls.clear()
        got = [o.token_ids for o in eng.generate(_prompts(n), sp)]
        assert got == [o.token_ids for o in ref.generate(_prompts(n), sp)]
        assert ("decode_layers" in calls) == (n <= 2), (n, calls)
        assert all(r <= 2 for r in calls.get("decode_layers", []))
        assert "linear" not in calls
        assert calls["argmax_rows"]


def test_engine_modes(module, calib, tiny_model, monkeypatch):
    """auto with a calibration that chose nothing: no kernels (and no weight copies);
    true: everywhere, without calibrating; false and MEGATRON_TLT_NO_CPU_KERNELS=1:
    eager."""
    model, arch = tiny_model
    calib.write_text(json.dumps(_record({})))

    def engine(mode):
        return RolloutEngine(model, None, RolloutConfig(cpu_kernels=mode), arch=arch,
                             eos_token_ids=[])
    eng = engine("auto")
    assert eng.runner.kernels is None
    eng.generate(_prompts(2), SamplingParams(temperature=0.0, max_new_tokens=2))
    assert eng.runner._panels == {}
    monkeypatch.setattr(kernel_policy, "calibrate", lambda *a, **k: pytest.fail("measured"))
    calib.unlink()
    assert engine(True).runner.kernels.policy is ALWAYS
    assert engine("false").runner.kernels is None
    monkeypatch.setenv("MEGATRON_TLT_NO_CPU_KERNELS", "1")
    assert engine("true").runner.kernels is None
    assert engine("auto").runner.kernels is None
