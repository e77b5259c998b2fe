#!/usr/bin/env python
"""`make gpu-check`: one prepared command for a machine with one NVIDIA GPU and no network.

    make gpu-wheels                 # here, with network: gpu_wheels/ (tools/wheel_folder.py)
    make gpu-check                  # there: python3 tools/gpu_check.py
    GPU_CHECK_DRY=1 make gpu-check  # here, on CPU: every part with the GPU steps stubbed

Parts, each a process with its own time limit (BUDGET_S: killed when it overruns,
recorded, and the next part runs); the whole check fits 8 minutes on an H100:

1. install: the wheel folder into a target folder (``pip install --no-index --no-deps
   --target``) on the machine's own python, whose CUDA torch is used; imports checked.
2. assets: a random-weight model of SmolLM2-135M-Instruct's shape and tokenizer (the
   real weights do not fit the 64 MiB that travels; tools/gpu_check_parts.py).
3. tests_gpu: ``pytest tests_gpu -rs`` (JUnit XML summarised in the JSON).
4. grpo: 3 GRPO steps of the demo recipe on one GPU (torchrun, 1 process: NCCL, bf16,
   megatron-core's distributed optimizer, selective recomputation where the config has
   it, the Transformer Engine spec when TE is importable, speculation on through the
   drafter group's random drafter), and 1 step of the same seeds in fp32: first-step
   loss and grad norm compared; peak GPU memory per phase against the dry run.
5. drafter: the drafter group's training micro-step on the GPU.
6. bench_spec (T=0 and T=1 coupled) and 7. bench_rollout, with CUDA graphs, --quick.

Results: ``gpu_check.json`` (every part's status, seconds, budget and result), the log
and the bench JSONs, in ``--out`` (default: ``$OUT`` when set, else
docs/results/gpu_check_<date>/ on a GPU and a temporary folder for the dry run).

The dry run (``--dry``; CPU, gloo, a 2-layer model of SmolLM2's vocabulary, a few
tokens): the install unpacks the cp312 wheels for Python 3.12 without importing them,
tests_gpu is collected (every required test must be), the GRPO runs take one step each,
and the benches run at their smallest sizes. ``--smoke`` (the CI test) further replaces
the GRPO runs by the recipe's ``--dry-run`` with the same overrides and skips the
benches.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import date, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "gpu_wheels"


def _sibling(name: str):
    """A module of tools/ by file (this script runs before anything is installed)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


wheel_folder = _sibling("wheel_folder")
PLATFORMS, manifest = wheel_folder.PLATFORMS, wheel_folder.manifest
RECIPE = "examples/rl/smollm2_cpu.yaml"

# Seconds per part on one H100 (the part's time limit there). Sum <= TOTAL_BUDGET_S.
BUDGET_S = {"install": 40, "assets": 20, "tests_gpu": 150, "grpo": 130, "drafter": 25,
            "bench_spec": 70, "bench_rollout": 45}
TOTAL_BUDGET_S = 480
# the dry run's limits on 2 shared CPU cores (no GPU: everything is slower)
DRY_BUDGET_S = {"install": 60, "assets": 90, "tests_gpu": 90, "grpo": 400, "drafter": 240,
                "bench_spec": 240, "bench_rollout": 240}

# tests_gpu tests that must be collected (issue 47 and docs/running_at_scale.md)
REQUIRED_GPU_TESTS = [
    "test_cuda_engine_matches_transformers", "test_cuda_graphs_match_eager_decoding",
    "test_bf16_decoding_follows_fp32", "test_transformer_engine_target_matches_local",
    "test_greedy_speculation_equals_plain_on_cuda",
    "test_sampled_speculation_reproduces_target_distribution_on_cuda",
    "test_fp8_drafter_keeps_acceptance", "test_fp8_drafter_trains_like_bf16",
    "test_async_save_on_cuda_is_a_host_snapshot",
    "test_value_helpers_at_world_size_1_on_nccl", "test_tensor_helpers_at_world_size_1_on_nccl",
    "test_tensor_helpers_refuse_cpu_tensors_on_nccl",
    "test_rollout_memory_released_and_recreated_on_cuda",
    "test_rollout_memory_is_released_and_graphs_recaptured",
    "test_recomputation_on_cuda_lowers_peak_memory",
    "test_chunked_loss_peak_is_a_fraction_of_unchunked",
    "test_scaled_mm_linear_matches_the_dequantized_reference",
    "test_fp8_self_drafter_greedy_equals_plain_on_cuda",
    "test_fp8_self_drafter_coupled_equals_plain_on_cuda",
    "test_fp8_copy_refresh_equals_quantizing_the_new_weights_on_cuda",
    "test_graphed_speculation_equals_eager_speculation_on_cuda",
    "test_graphed_self_drafter_verification_equals_eager_on_cuda",
    "test_graphs_in_the_gathered_pp_mode_on_cuda", "test_cuda_graphs_auto_is_on_with_cuda",
    "test_padding_rows_attend_over_their_own_length_on_cuda",
    "test_cuda_graphs_auto_measures_each_key_once_and_equals_eager",
    "test_graph_pool_memory_matches_the_dry_run_model",
    "test_policy_moments_allocated_at_build_on_cuda",
]
# first-step agreement of the bf16 run with the fp32 run (same seeds, coupled sampling)
LOSS_ATOL, LOSS_RTOL, GRAD_NORM_RTOL = 0.02, 0.05, 0.25
MEMORY_TOLERANCE = 0.15  # measured peak within +-15 % of the dry run's total
NOTES = [
    "Weights are random (seed 0) in SmolLM2-135M-Instruct's shape with its tokenizer: "
    "the real weights' smallest form (the 98 MB GGUF) does not fit the 64 MiB that "
    "travels with a GPU job. Speed and memory are SmolLM2's; acceptance and rewards are "
    "not (a format reward, the letter z, gives the GRPO groups reward variance).",
    "Transformer Engine is not carried: its PyTorch extension is source-only (about 2 "
    "minutes to build there) and its CUDA library wheel alone is far over 64 MiB. The "
    "check uses the local spec and the TE tests skip unless TE is already importable.",
]


def log(msg: str) -> None:
    print(f"[gpu-check {datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- running
class Check:
    def __init__(self, args):
        self.args, self.dry, self.smoke = args, args.dry or args.smoke, args.smoke
        self.budget = dict(DRY_BUDGET_S if self.dry else BUDGET_S)
        for item in args.budget:
            k, v = item.split("=")
            self.budget[k] = float(v)
        self.work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        # the dry run unpacks Python 3.12 wheels: into a folder that is not imported
        self.site = self.work / ("site_py312_unused" if self.dry else "site")
        self.wheels = Path(args.wheels)
        self.log_path = self.out / "gpu_check.log"
        self.parts: dict[str, dict] = {}
        self.env = dict(os.environ)
        # SmolLM2's shape files when the wheel folder has none: this machine's asset
        source_cache = (self.env.get("MEGATRON_TLT_CACHE")
                        or Path.home() / ".cache" / "megatron_tlt")
        self.shape_src = Path(source_cache).expanduser() / "SmolLM2-135M-Instruct"
        self.env.update(PYTHONUNBUFFERED="1", MEGATRON_TLT_CACHE=str(self.work / "cache"),
                        PYTHONPATH=os.pathsep.join(
                            ([] if self.dry else [str(self.site)]) + [str(REPO)]
                            + ([self.env["PYTHONPATH"]] if self.env.get("PYTHONPATH") else [])))
        if self.dry:  # CPU only; no kernel compile into the fresh cache
            self.env.update(CUDA_VISIBLE_DEVICES="", MEGATRON_TLT_NO_CPU_KERNELS="1")
        self.py = sys.executable
        self._fields: set[str] | None = None  # the config's section.field names

    # a command under the part's remaining time: killed with its process group
    def run(self, name: str, cmd: list[str], deadline: float, env=None,
            output: Path | None = None) -> dict:
        """``cmd`` until ``deadline``; its output goes to the log (or ``output``)."""
        left = deadline - time.monotonic()
        rec = {"cmd": " ".join(map(str, cmd))}
        if left <= 0:
            return {**rec, "rc": None, "timed_out": True}
        log(f"{name}: {rec['cmd']}")
        with open(output or self.log_path, "a") as f:
            f.write(f"\n===== {name}: {rec['cmd']}\n")
            f.flush()
            p = subprocess.Popen(list(map(str, cmd)), cwd=REPO, env=env or self.env,
                                 stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rec["rc"] = p.wait(timeout=left)
                rec["timed_out"] = False
            except subprocess.TimeoutExpired:
                # the whole process group (torchrun's workers, pytest's children): a
                # TERM, 5 s to exit, then a KILL for whatever is left of the group
                for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
                    try:
                        p.wait(timeout=grace)
                    except subprocess.TimeoutExpired:
                        pass
                rec.update(rc=p.returncode, timed_out=True)
                f.write(f"\n===== {name}: killed after its limit\n")
        return rec

    def part(self, name: str, fn) -> None:
        if self.args.parts and name not in self.args.parts:
            return
        budget = self.budget[name]
        t0 = time.monotonic()
        deadline = t0 + budget
        log(f"part {name} (limit {budget:.0f} s)")
        try:
            status, result, cmds = fn(deadline)
        except Exception as e:  # noqa: BLE001 - a broken part is recorded, the rest run
            status, result, cmds = "failed", {"error": f"{type(e).__name__}: {e}"}, []
        seconds = time.monotonic() - t0
        if any(c.get("timed_out") for c in cmds):
            status = "timeout"
        self.parts[name] = {"status": status, "seconds": round(seconds, 1),
                            "budget_s": budget, "commands": cmds, "result": result}
        log(f"part {name}: {status} in {seconds:.1f} s")
        self.write_summary()

    def _json(self, path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    # ------------------------------------------------------------------ the parts
    def install(self, deadline):
        wheels = sorted(self.wheels.glob("*.whl"))
        sdists = sorted(self.wheels.glob("*.tar.gz"))
        if not wheels and not sdists:
            return ("failed" if not self.dry else "skipped",
                    {"reason": f"no wheels in {self.wheels}: run `make gpu-wheels` on a "
                               "networked machine and carry the folder"}, [])
        base = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--upgrade", "--target", str(self.site)]
        if self.dry:  # unpack the cp312 wheels for Python 3.12 without importing them
            base += ["--only-binary=:all:", "--python-version", "3.12", "--implementation",
                     "cp", *[f"--platform={p}" for p in PLATFORMS + ["linux_x86_64"]]]
        cmds = [self.run("install", [self.py, *base, *wheels], deadline)]
        if sdists and not self.dry:
            cmds.append(self.run("install", [self.py, *base, "--no-build-isolation",
                                             *sdists], deadline))
        res = {"wheels": [p.name for p in wheels + sdists],
               "bytes": sum(p.stat().st_size for p in wheels + sdists)}
        if not self.dry:
            probe = ("import json, importlib, torch; mods = ['megatron.core', 'omegaconf', "
                     "'reasoning_gym', 'math_verify', 'transformer_engine.pytorch']; "
                     "got = {}\nfor m in mods:\n  try:\n    mod = importlib.import_module(m)"
                     "; got[m] = getattr(mod, '__version__', 'ok')\n  except Exception as e:"
                     " got[m] = 'missing: ' + type(e).__name__\n"
                     "got['torch'] = torch.__version__; got['cuda'] = torch.cuda.is_available()"
                     "\nprint('IMPORTS ' + json.dumps(got))")
            out = self.work / "imports.txt"
            cmds.append(self.run("install", [self.py, "-c", probe], deadline, output=out))
            lines = out.read_text().splitlines()
            line = next((x for x in lines if x.startswith("IMPORTS ")), "")
            res["imports"] = json.loads(line[8:]) if line else {"error": lines[-30:]}
        try:
            res["manifest_unmet"] = manifest(self.wheels)["unmet_requirements"]
        except Exception as e:  # noqa: BLE001 - recorded with the commands that ran
            res["manifest_unmet"] = {"error": f"{type(e).__name__}: {e}"}
        ok = all(c["rc"] == 0 for c in cmds) and not res["manifest_unmet"] and all(
            not str(v).startswith("missing") for k, v in res.get("imports", {}).items()
            if k != "transformer_engine.pytorch")
        return ("passed" if ok else "failed"), res, cmds

    def te_available(self) -> bool:
        imports = self.parts.get("install", {}).get("result", {}).get("imports", {})
        return not str(imports.get("transformer_engine.pytorch", "missing")).startswith(
            "missing")

    def assets(self, deadline):
        shape = self.wheels / "smollm2_shape"
        if not (shape / "config.json").is_file():  # here: the prepared asset
            shape = self.shape_src
        res_path = self.work / "assets.json"
        cmd = [self.py, "tools/gpu_check_parts.py", "assets", "--shape", shape,
               "--cache", self.work / "cache", "--result", res_path]
        c = self.run("assets", cmd + (["--mini"] if self.dry else []), deadline)
        res = self._json(res_path)
        return ("passed" if c["rc"] == 0 and res.get("ok") else "failed"), res, [c]

    def tests_gpu(self, deadline):
        if self.dry:
            env = {**self.env, "GPU_CHECK_COLLECT_ONLY": "1"}
            out = self.work / "collect.txt"
            c = self.run("tests_gpu", [self.py, "-m", "pytest", "tests_gpu", "--collect-only",
                                       "-q", "-p", "no:cacheprovider"], deadline, env, out)
            text = out.read_text()
            with open(self.log_path, "a") as f:
                f.write(text)
            ids = [x for x in text.splitlines() if "::" in x and not x.startswith("=====")]
            names = {x.split("::")[-1].split("[")[0] for x in ids}
            missing = [t for t in REQUIRED_GPU_TESTS if t not in names]
            res = {"collected": len(ids), "missing_required": missing}
            return ("passed" if c["rc"] == 0 and not missing else "failed"), res, [c]
        xml = self.work / "tests_gpu.xml"
        per_test = max(30, int(self.budget["tests_gpu"] // 2))
        c = self.run("tests_gpu", [self.py, "-m", "pytest", "tests_gpu", "-rs", "-q",
                                   "-p", "no:cacheprovider", f"--timeout={per_test}",
                                   f"--junitxml={xml}"], deadline)
        res = junit_summary(xml)
        ok = c["rc"] == 0 and res.get("failed", 1) == 0 and res.get("errors", 1) == 0
        return ("passed" if ok else "failed"), res, [c]

    def _grpo_overrides(self, tag: str, dtype: str, steps: int) -> list[str]:
        if self._fields is None:
            self._fields = config_fields(self.env, self.py)
        cfg_fields = self._fields
        impl = "transformer_engine" if self.te_available() else "local"
        o = ["model.hf_path=smollm2", f"model.dtype={dtype}", f"model.transformer_impl={impl}",
             f"train.steps={steps}", "train.eval_interval=0", "data.eval_size=0",
             "data.train_size=64", "train.optimizer=auto", "drafter_group.enable=true",
             # speculation on at every step (a random drafter: the adaptive gate would
             # rightly decline it): a fixed strategy, any batch size
             "rollout.speculative.policy=fixed", "rollout.speculative.strategy=4_1_4",
             "rollout.speculative.threshold=64", "rollout.sampling_mode=coupled",
             # random weights: a format reward that about half the responses earn gives
             # every group reward variance (a task reward would be 0 everywhere)
             "reward.format_reward=1.0", "reward.format_pattern=z",
             "checkpoint.export_hf=false", "tracking.wandb_mode=disabled",
             "tracking.plots=false", f"tracking.output_dir={self.work / 'runs'}",
             f"tracking.run_name={tag}", "tracking.on_existing_run=new_version"]
        o += [f for f in ("train.recompute_granularity=selective",)
              if f.split("=")[0] in cfg_fields]  # (where the config has the field)
        if self.dry:
            o += ["platform.device=cpu", "platform.backend=gloo", "grpo.prompts_per_step=1",
                  "grpo.group_size=4", "grpo.max_new_tokens=8", "train.micro_batch_size=4"]
        else:
            o += ["platform.device=cuda", "platform.backend=nccl", "grpo.max_new_tokens=48"]
        return o

    def grpo(self, deadline):
        runs, cmds, res = {}, [], {}
        plan = [("bf16", "bfloat16", 1 if self.dry else 3), ("fp32", "float32", 1)]
        if self.smoke:  # one validation of the override list is enough
            plan = plan[:1]
        for tag, dtype, steps in plan:
            over = self._grpo_overrides(tag, dtype, steps)
            if self.smoke:  # the recipe and overrides validated, nothing trained
                cmds.append(self.run("grpo", [self.py, "pretrain_rl_tlt.py", "--config",
                                              RECIPE, *over, "--dry-run"], deadline))
                continue
            rp = self.work / f"grpo_{tag}.json"
            cmds.append(self.run("grpo", [
                self.py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                "1", "tools/gpu_check_parts.py", "grpo", "--result", rp, "--",
                "--config", RECIPE, *over], deadline))
            runs[tag] = self._json(rp)
        if self.smoke:
            return ("passed" if all(c["rc"] == 0 for c in cmds) else "failed"), {}, cmds
        res["runs"] = {k: {kk: vv for kk, vv in v.items() if kk != "dry_run"}
                       for k, v in runs.items()}
        res["dry_run_report"] = runs.get("bf16", {}).get("dry_run", {}).get("report")
        res["comparison"] = compare_first_step(runs.get("bf16", {}), runs.get("fp32", {}))
        res["memory"] = memory_verdict(runs.get("bf16", {}))
        ok = (all(c["rc"] == 0 for c in cmds) and all(r.get("ok") for r in runs.values())
              and res["comparison"].get("within_tolerance", False))
        return ("passed" if ok else "failed"), res, cmds

    def drafter(self, deadline):
        rp = self.work / "drafter.json"
        c = self.run("drafter", [self.py, "tools/gpu_check_parts.py", "drafter",
                                 "--result", rp] + (["--steps", "3", "--new-tokens", "8"]
                                                    if self.dry else []), deadline)
        res = self._json(rp)
        return ("passed" if c["rc"] == 0 and res.get("ok") else "failed"), res, [c]

    def bench_spec(self, deadline):
        if self.smoke:
            return "skipped", {"reason": "--smoke"}, []
        if self.dry:
            runs = [("t0", ["--batch-sizes", "1", "--prompts", "1", "--new-tokens", "6",
                            "--tail-prompts", "2", "--tail-tokens", "6", "--pairs", "1",
                            "--tail-pairs", "1", "--tail-fixed", "none"])]
        else:  # random weights: near-flat bf16 logits, so the near-tie margin is wider
            runs = [("t0", ["--quick", "--cuda-graphs", "--tie-margin", "0.1"]),
                    ("t1", ["--quick", "--batch-sizes", "1", "--tail-fixed", "none",
                            "--cuda-graphs", "--temperature", "1", "--sampling-mode",
                            "coupled"])]
        cmds, res = [], {}
        for tag, extra in runs:
            out = self.out / f"bench_spec_{tag}.json"
            cmds.append(self.run("bench_spec", [self.py, "tools/bench_spec.py", "--drafter",
                                                "random", "--alpha-prompts", "0", *extra,
                                                "--json", out], deadline))
            full = self._json(out)
            res[tag] = {k: v for k, v in full.items() if k not in ("results", "tail", "config")}
        ok = all(c["rc"] == 0 for c in cmds)
        return ("passed" if ok else "failed"), res, cmds

    def bench_rollout(self, deadline):
        if self.smoke:
            return "skipped", {"reason": "--smoke"}, []
        extra = (["--batch-sizes", "1", "--new-tokens", "6", "--pairs", "1",
                  "--cpu-kernels", "false"] if self.dry else ["--quick", "--cuda-graphs"])
        out = self.out / "bench_rollout.json"
        c = self.run("bench_rollout", [self.py, "tools/bench_rollout.py", *extra,
                                       "--json", out], deadline)
        full = self._json(out)
        res = {k: v for k, v in full.items() if k != "config"}
        return ("passed" if c["rc"] == 0 and full else "failed"), res, [c]

    # ------------------------------------------------------------------ the summary
    def write_summary(self, final: bool = False) -> dict:
        seconds = sum(p["seconds"] for p in self.parts.values())
        s = {"mode": "smoke" if self.smoke else "dry" if self.dry else "gpu",
             "date": str(date.today()), "total_budget_s": TOTAL_BUDGET_S,
             "budget_s": self.budget, "seconds": round(seconds, 1),
             "within_budget": seconds <= (TOTAL_BUDGET_S if not self.dry else
                                          sum(self.budget.values())),
             "finished": final, "wheels": str(self.wheels),
             "transformer_engine": self.te_available(), "notes": NOTES,
             "passed": all(p["status"] in ("passed", "skipped") for p in self.parts.values()),
             "parts": self.parts}
        (self.out / "gpu_check.json").write_text(json.dumps(s, indent=1, default=str))
        return s

    def main(self) -> int:
        log(f"results in {self.out}, work folder {self.work}")
        for name in BUDGET_S:
            self.part(name, getattr(self, name))
        s = self.write_summary(final=True)
        for name, p in self.parts.items():
            log(f"{name:14s} {p['status']:8s} {p['seconds']:7.1f} s (limit {p['budget_s']:.0f})")
        log(f"total {s['seconds']:.1f} s; {'PASSED' if s['passed'] else 'FAILED'}")
        return 0 if s["passed"] else 1


def config_fields(env: dict, py: str) -> set[str]:
    """Every section.field the installed megatron_tlt config knows."""
    code = ("import dataclasses as d, json\nfrom megatron_tlt.config import Config\n"
            "c = Config()\nout = []\nfor f in d.fields(c):\n  s = getattr(c, f.name)\n"
            "  if d.is_dataclass(s):\n    out += [f.name + '.' + g.name for g in d.fields(s)]\n"
            "print(json.dumps(out))")
    r = subprocess.run([py, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    try:
        return set(json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return set()


def junit_summary(xml: Path) -> dict:
    """Counts, failures and skip reasons of a pytest JUnit XML report."""
    if not xml.is_file():
        return {"error": "no JUnit report (pytest did not finish)"}
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    out = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    out["failed"] = out.pop("failures")
    out["seconds"] = float(suite.get("time", 0))
    out["passed"] = out["tests"] - out["failed"] - out["errors"] - out["skipped"]
    out["failed_tests"], out["skipped_tests"] = {}, {}
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name')}"
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                out["failed_tests"][name] = (el.get("message") or "")[:800]
        el = case.find("skipped")
        if el is not None:
            out["skipped_tests"][name] = (el.get("message") or "")[:300]
    return out


def compare_first_step(bf16: dict, fp32: dict) -> dict:
    """The bf16 run's first-step loss and grad norm against the fp32 run's."""
    a, b = bf16.get("first_loss"), fp32.get("first_loss")
    ga, gb = bf16.get("first_grad_norm"), fp32.get("first_grad_norm")
    if None in (a, b, ga, gb):
        return {"within_tolerance": False, "reason": "a run has no first step"}
    loss_ok = abs(a - b) <= LOSS_ATOL + LOSS_RTOL * abs(b)
    gn_ok = abs(ga - gb) <= GRAD_NORM_RTOL * abs(gb)
    return {"loss_bf16": a, "loss_fp32": b, "grad_norm_bf16": ga, "grad_norm_fp32": gb,
            "loss_tolerance": f"|d| <= {LOSS_ATOL} + {LOSS_RTOL} x |fp32|",
            "grad_norm_tolerance": f"|d| <= {GRAD_NORM_RTOL} x fp32",
            "within_tolerance": loss_ok and gn_ok}


def memory_verdict(run: dict) -> dict:
    """Measured peak (CUDA, per phase) against the dry run's total for the same config."""
    pred = run.get("dry_run", {}).get("gib", {})
    ratio = run.get("measured_over_predicted")
    return {"peak_gib_by_phase": run.get("peak_gib_by_phase"),
            "peak_gib_overall": run.get("peak_gib_overall"),
            "memory_kind": run.get("memory_kind"), "predicted_gib": pred,
            "measured_over_predicted": ratio,
            "within_15pct": None if ratio is None else abs(ratio - 1) <= MEMORY_TOLERANCE}


def default_out(dry: bool) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    if dry:
        return Path(tempfile.gettempdir()) / "gpu_check_dry"
    return REPO / "docs" / "results" / f"gpu_check_{date.today()}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", default=bool(os.environ.get("GPU_CHECK_DRY")),
                    help="CPU: every part with the GPU steps stubbed (also GPU_CHECK_DRY=1)")
    ap.add_argument("--smoke", action="store_true",
                    help="--dry, GRPO validated by --dry-run only, no benches (CI)")
    ap.add_argument("--wheels", default=str(WHEELS), help="the wheel folder")
    ap.add_argument("--out", default=None, help="results folder (default: $OUT, else "
                    "docs/results/gpu_check_<date>/, dry: a temporary folder)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--parts", nargs="*", default=None, choices=list(BUDGET_S),
                    help="run only these parts")
    ap.add_argument("--budget", nargs="*", default=[], metavar="PART=SECONDS",
                    help="override a part's time limit")
    args = ap.parse_args(argv)
    args.out = args.out or str(default_out(args.dry or args.smoke))
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
