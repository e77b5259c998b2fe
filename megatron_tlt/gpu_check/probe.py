"""What the GPU machine offers, read once by the check's install part (``python -m
megatron_tlt.gpu_check.probe --result R.json``) and by tests_gpu's FP8 tests:

- ``imports()``: the version of each package the check needs (or why it is missing);
- ``device()``: torch, CUDA, the GPU's name, memory and compute capability;
- ``fp8_probe()``: whether ``torch._scaled_mm`` multiplies row-wise-scaled E4M3 here,
  and if not, why. The self-drafter's ``rollout.speculative.kinds.self.format=auto``
  picks FP8 only where this works (``quantize_fp8.fp8_native``, the same 16 x 16 call), else
  int8; so a torch release whose row-wise kernel fails turns the FP8 drafter into int8
  silently. The probe keeps the reason: ``device_lacks_fp8`` is true only for a
  device of compute capability below 8.9 (or no CUDA), where FP8 tests skip; on a
  device that has FP8 a failing call is a failure, with its message.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

MODULES = ("megatron.core", "omegaconf", "reasoning_gym", "math_verify", "transformers",
           "safetensors", "numpy", "triton", "transformer_engine.pytorch", "flash_attn")
FP8_CAPABILITY = (8, 9)
ALIGN = 16


def imports(modules=MODULES) -> dict:
    got = {}
    for m in modules:
        try:
            mod = importlib.import_module(m)
            got[m] = str(getattr(mod, "__version__", "ok"))
        except Exception as e:  # noqa: BLE001 - any import failure is "missing", with why
            got[m] = f"missing: {type(e).__name__}: {str(e)[:200]}"
    return got


def device() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    if out["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        out.update(name=props.name, capability=list(torch.cuda.get_device_capability(0)),
                   memory_gib=round(props.total_memory / 2 ** 30, 1),
                   multiprocessors=props.multi_processor_count)
    return out


def fp8_probe() -> dict:
    """``torch._scaled_mm`` with row-wise scales on device 0: {"native", "reason",
    "device_lacks_fp8", ...}. ``native`` is what the self-drafter's auto format sees."""
    import torch

    out = {"torch": torch.__version__, "native": False, "device_lacks_fp8": True}
    if not torch.cuda.is_available():
        return {**out, "reason": "no CUDA device"}
    cap = tuple(torch.cuda.get_device_capability(0))
    out["capability"] = list(cap)
    if cap < FP8_CAPABILITY:
        return {**out, "reason": f"compute capability {cap[0]}.{cap[1]} < 8.9: no FP8 GEMMs"}
    out["device_lacks_fp8"] = False
    if not hasattr(torch, "_scaled_mm"):
        return {**out, "reason": f"torch {torch.__version__} has no torch._scaled_mm"}
    dev = torch.device("cuda", 0)
    e4m3 = torch.float8_e4m3fn
    try:  # the self-drafter's probe (quantize_fp8.fp8_native), kept with its error
        a = torch.zeros(1, ALIGN, dtype=e4m3, device=dev)
        b = torch.zeros(ALIGN, ALIGN, dtype=e4m3, device=dev).t()
        torch._scaled_mm(a, b, torch.ones(1, 1, device=dev),
                         torch.ones(1, ALIGN, device=dev), out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return {**out, "reason": f"torch._scaled_mm (row-wise scales) failed: "
                                 f"{type(e).__name__}: {str(e)[:500]}"}
    out.update(native=True, reason="torch._scaled_mm row-wise E4M3 runs")
    try:  # what the engine itself decides (the package may not import before install)
        from megatron_tlt.rollout.speculative.quantize_fp8 import fp8_native

        out["engine_fp8_native"] = bool(fp8_native(dev))
    except Exception as e:  # noqa: BLE001
        out["engine_fp8_native"] = f"not read: {type(e).__name__}: {str(e)[:200]}"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--result", required=True, help="JSON written here")
    args = ap.parse_args(argv)
    out = {"imports": imports()}
    try:
        out["device"] = device()
        out["fp8"] = fp8_probe()
    except Exception as e:  # noqa: BLE001 - recorded: torch itself failed
        out["error"] = f"{type(e).__name__}: {e}"
    Path(args.result).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
