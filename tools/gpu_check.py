#!/usr/bin/env python
"""`make gpu-check`: one prepared command for a lent machine with one NVIDIA GPU, no
network and a 10-minute limit per command (docs/running_at_scale.md, "The GPU check").

    make gpu-wheels                                 # here, with network: gpu_wheels/
    PYTHONPATH=$PWD python3 tools/gpu_check.py      # there (its own python3, CUDA torch)
    GPU_CHECK_DRY=1 make gpu-check                  # here, on CPU (tools/gpu_check.py --dry)

Before any part the wheel folder is verified (every pinned wheel, SmolLM2's shape
files, every requirement met): an incomplete folder stops the check at once, exit
status 2, with what is missing and how to make it (``--allow-incomplete-wheels`` runs
on). The parts run in priority order under one wall deadline (``--deadline``, 540 s by
default, counted from the start; the GPU caps add up to it): a part starts only with at
least its minimum left (else "skipped: no time left"), runs for at most its cap and
what is left, and has its process tree (torchrun's workers in their own sessions
included) killed when that time is up (megatron_tlt/gpu_check/schedule.py).
``gpu_check.json`` is rewritten as each part starts and ends.

1. install: the wheel folder into a target folder (``pip install --no-index --no-deps
   --target``) on the machine's own python, whose CUDA torch is used; then the probe
   (imports, the device, ``torch._scaled_mm``'s row-wise FP8 with its reason).
2. assets: a random-weight model of SmolLM2-135M-Instruct's shape and tokenizer.
3. tests_gpu: one pytest over tests_gpu/ in priority order, each result streamed to
   ``tests_gpu.jsonl`` as it finishes; a test over ``--per-test`` seconds or a crash is
   recorded and the rest run on (megatron_tlt/gpu_check/tests_run.py).
4. grpo: 3 GRPO steps of the demo recipe on one GPU (torchrun, 1 process: NCCL, bf16,
   megatron-core's distributed optimizer, selective recomputation, the TE spec when TE
   is importable, speculation on through the drafter group's random drafter); peak GPU
   memory per phase against the dry run's prediction.
5. first_step: bf16 against fp32 on identical, teacher-forced responses: loss and grad
   norm of one update (megatron_tlt/gpu_check/first_step.py).
6. bench_rollout: graphed plain decode step times (--quick, CUDA graphs).
7. bench_spec (T=0, and T=1 coupled), with CUDA graphs, --quick: step times only (the
   weights are random, so its JSON says ``timing_only``).
8. drafter: the drafter group's training micro-step on the GPU.
9. tests_gpu_rest: the tests that part 3's cap left unrun, in the time left.

Results in ``--out`` (default ``$OUT``; else docs/results/gpu_check_<date>/ on a GPU, a
temporary folder for the dry run): ``gpu_check.json``, ``tests_gpu.jsonl``,
``gpu_check.log`` (kept under 12 MiB) and the three bench JSONs: 6 files.

The dry run (``--dry``; CPU, gloo, a 2-layer model of SmolLM2's vocabulary, a few
tokens): the install unpacks the cp312 wheels for Python 3.12 without importing them,
tests_gpu is collected through the same runner (every required test must be), the GRPO
run takes one step, the benches run at their smallest sizes. ``--smoke`` (the CI test)
further replaces the GRPO run by the recipe's ``--dry-run`` with the same overrides and
skips the first step and the benches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import date
from pathlib import Path

try:  # (standard library only: the check starts before anything is installed there)
    from megatron_tlt.gpu_check.schedule import Part, Schedule, log, run_command
    from megatron_tlt.gpu_check.tests_run import ordered_files, run_tests, summarize
    from megatron_tlt.gpu_check.wheels import PLATFORMS, folder_problems, manifest
except ImportError as e:  # the GPU machine has the repository, not the installed package
    sys.exit(f"error: {e}. The check needs the megatron_tlt package importable; where it "
             "is not installed, run it from the repository root as "
             "`PYTHONPATH=$PWD python3 tools/gpu_check.py`")

REPO = Path(__file__).resolve().parents[1]

WHEELS = REPO / "gpu_wheels"
RECIPE = "examples/rl/smollm2_cpu.yaml"
DEADLINE_S = 540  # of the 600 s a command may run there: 60 s for start-up and $OUT
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# Parts in priority order (by value: CUDA correctness, the GRPO steps with memory per
# phase, graphed decode step times, then the benches), as (cap: the most seconds it may
# take, min: the fewest worth starting it with). On the GPU the caps add up to the
# deadline less the summary's reserve (a test holds them to it), so no part's cap is
# promised time that another took; tests_gpu_rest gets whatever the others left. The
# CPU dry run's caps (2 shared cores) are its own and may overrun: its last parts are
# then skipped for time, as on the GPU.
PLAN = {"install": (35, 10), "assets": (25, 10), "tests_gpu": (180, 30), "grpo": (110, 60),
        "first_step": (35, 20), "bench_rollout": (45, 25), "bench_spec": (70, 40),
        "drafter": (35, 20), "tests_gpu_rest": (DEADLINE_S, 30)}
DRY_PLAN = {"install": (120, 10), "assets": (120, 20), "tests_gpu": (120, 20),
            "grpo": (400, 60), "first_step": (240, 30), "bench_rollout": (240, 30),
            "bench_spec": (240, 30), "drafter": (240, 30), "tests_gpu_rest": (0, 0)}
PER_TEST_S = 120  # a tests_gpu test (its module's fixtures included) past this is killed

# tests_gpu tests that must be collected (docs/running_at_scale.md)
REQUIRED_GPU_TESTS = (
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
)
REQUIRED_IMPORTS = ("megatron.core", "omegaconf", "reasoning_gym", "math_verify")
NOTES = [
    "Weights are random (seed 0) in SmolLM2-135M-Instruct's shape with its tokenizer: "
    "the real weights' smallest form (the 98 MB GGUF) does not fit the 64 MiB that "
    "travels with a GPU job. Speed and memory are SmolLM2's; acceptance and rewards are "
    "not (a format reward, the letter z, gives the GRPO groups reward variance).",
    "Transformer Engine is not carried: its PyTorch extension is source-only (about 2 "
    "minutes to build there) and its CUDA library wheel alone is far over 64 MiB. The "
    "check uses the local spec and the TE tests skip unless TE is already importable.",
]


class Check:
    def __init__(self, args):
        self.args, self.dry, self.smoke = args, args.dry or args.smoke, args.smoke
        self.plan = {k: list(v) for k, v in (DRY_PLAN if self.dry else PLAN).items()}
        for item in args.cap:
            k, v = item.split("=")
            self.plan[k][0] = float(v)
        self.work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        # the dry run unpacks Python 3.12 wheels: into a folder that is not imported
        self.site = self.work / ("site_py312_unused" if self.dry else "site")
        self.wheels = Path(args.wheels)
        self.log_path = self.out / "gpu_check.log"
        self.stream = self.out / "tests_gpu.jsonl"
        self.probe: dict = {}
        self.folder_problems: list[str] = []
        self.stopped = False  # by an incomplete wheel folder, before any part
        os.environ.update(OFFLINE)  # nothing here may reach a hub
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

    def run(self, name: str, cmd: list, deadline: float, env=None,
            output: Path | None = None) -> dict:
        return run_command(name, cmd, deadline, log_path=self.log_path, cwd=REPO,
                           env=env or self.env, output=output)

    def _json(self, path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def _part_py(self, name: str, part: str, result: Path, deadline: float,
                 extra=(), rest=()) -> tuple:
        cmd = [self.py, "-m", "megatron_tlt.gpu_check.parts", part, "--result", result,
               *extra] + (["--", *rest] if rest else [])
        c = self.run(name, cmd, deadline)
        res = self._json(result)
        return _status(c["rc"] == 0 and res.get("ok"), [c]), res, [c]

    # ------------------------------------------------------------------ the parts
    def install(self, deadline):
        wheels = sorted(self.wheels.glob("*.whl"))
        sdists = sorted(self.wheels.glob("*.tar.gz"))
        cmds, res = [], {"wheels": [p.name for p in wheels + sdists],
                         "bytes": sum(p.stat().st_size for p in wheels + sdists)}
        if not wheels and not sdists:
            res["reason"] = (f"no wheels in {self.wheels}: run `make gpu-wheels` on a "
                             "networked machine and carry the folder")
        else:
            base = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(self.site)]
            if self.dry:  # unpack the cp312 wheels for Python 3.12 without importing them
                base += ["--only-binary=:all:", "--python-version", "3.12", "--implementation",
                         "cp", *[f"--platform={p}" for p in PLATFORMS + ["linux_x86_64"]]]
            cmds.append(self.run("install", [self.py, *base, *wheels], deadline))
            if sdists and not self.dry:
                cmds.append(self.run("install", [self.py, *base, "--no-build-isolation",
                                                 *sdists], deadline))
            try:
                res["manifest_unmet"] = manifest(self.wheels)["unmet_requirements"]
            except Exception as e:  # noqa: BLE001 - recorded with the commands that ran
                res["manifest_unmet"] = {"error": f"{type(e).__name__}: {e}"}
        probe = self.work / "probe.json"
        cmds.append(self.run("install", [self.py, "-m", "megatron_tlt.gpu_check.probe",
                                         "--result", probe], deadline,
                             output=self.work / "probe.txt"))
        self.probe = self._json(probe)
        res["probe"] = self.probe
        imports = self.probe.get("imports", {})
        missing = [m for m in REQUIRED_IMPORTS if str(imports.get(m, "missing")).startswith(
            "missing")]
        res["missing_imports"] = missing
        ok = (bool(wheels or sdists) and all(c["rc"] == 0 for c in cmds)
              and not res.get("manifest_unmet") and not missing)
        if self.dry and not (wheels or sdists):
            return "skipped", res, cmds
        return _status(ok, cmds), res, cmds

    def te_available(self) -> bool:
        imports = self.probe.get("imports", {})
        return not str(imports.get("transformer_engine.pytorch", "missing")).startswith(
            "missing")

    def assets(self, deadline):
        shape = self.wheels / "smollm2_shape"
        if not (shape / "config.json").is_file():  # here: the prepared asset
            shape = self.shape_src
        if not (shape / "config.json").is_file():
            return "failed", {"reason": f"no SmolLM2 shape files in {self.wheels}/smollm2_shape "
                                        "(`make assets`, then `make gpu-wheels`)"}, []
        return self._part_py("assets", "assets", self.work / "assets.json", deadline,
                             ["--shape", shape, "--cache", self.work / "cache"]
                             + (["--mini"] if self.dry else []))

    def _tests_result(self, cmds: list) -> tuple:
        res = summarize(self.stream, REQUIRED_GPU_TESTS)
        res["stream"] = self.stream.name
        errors = [c["error"] for c in cmds if c.get("error")]
        if errors:
            res["errors"] = errors
        if self.dry:
            ok = not errors and res["collected"] and not res["missing_required"] and \
                not res["collection_errors"]
            return ("passed" if ok else "failed"), res, cmds
        bad = any(res[k] for k in ("failed", "error", "timeout", "crashed",
                                   "collection_errors")) or errors or not res["collected"]
        if bad:
            return "failed", res, cmds
        return ("passed" if not res["not_run"] else "incomplete"), res, cmds

    def tests_gpu(self, deadline):
        env = {**self.env, "GPU_CHECK_COLLECT_ONLY": "1"} if self.dry else self.env
        targets = ordered_files(REPO / "tests_gpu")
        if self.args.tests_after:  # a second call: only what the first left without a result
            targets = summarize(Path(self.args.tests_after))["not_run"]
            if not targets:
                return "skipped", {"reason": f"no test left to run in {self.args.tests_after}"}, []
        cmds = run_tests(self.py, targets, deadline,
                         stream=self.stream, log_path=self.log_path, cwd=REPO, env=env,
                         per_test_s=self.args.per_test, collect_only=self.dry)
        return self._tests_result(cmds)

    def tests_gpu_rest(self, deadline):
        left = summarize(self.stream)["not_run"] if self.stream.is_file() else []
        if self.dry or not left:
            return "skipped", {"reason": "no test left to run"}, []
        cmds = run_tests(self.py, left, deadline, stream=self.stream, log_path=self.log_path,
                         cwd=REPO, env=self.env, per_test_s=self.args.per_test)
        return self._tests_result(cmds)

    def _grpo_overrides(self, dtype: str, steps: int) -> list[str]:
        impl = "transformer_engine" if self.te_available() else "local"
        o = ["model.hf_path=smollm2", f"model.dtype={dtype}", f"model.transformer_impl={impl}",
             "train.recompute_granularity=selective",
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
             f"tracking.run_name={dtype}", "tracking.on_existing_run=new_version"]
        if self.dry:
            o += ["platform.device=cpu", "platform.backend=gloo", "grpo.prompts_per_step=1",
                  "grpo.group_size=4", "grpo.max_new_tokens=8", "train.micro_batch_size=4"]
        else:
            o += ["platform.device=cuda", "platform.backend=nccl", "grpo.max_new_tokens=48"]
        return o

    def grpo(self, deadline):
        over = self._grpo_overrides("bfloat16", 1 if self.dry else 3)
        if self.smoke:  # the recipe and overrides validated, nothing trained
            c = self.run("grpo", [self.py, "pretrain_rl_tlt.py", "--config", RECIPE, *over,
                                  "--dry-run"], deadline)
            return _status(c["rc"] == 0, [c]), {}, [c]
        rp = self.work / "grpo.json"
        c = self.run("grpo", [self.py, "-m", "torch.distributed.run", "--standalone",
                              "--nproc_per_node", "1", "-m", "megatron_tlt.gpu_check.parts",
                              "grpo", "--result", rp, "--", "--config", RECIPE, *over], deadline)
        res = self._json(rp)
        return _status(c["rc"] == 0 and res.get("ok"), [c]), res, [c]

    def first_step(self, deadline):
        if self.smoke:
            return "skipped", {"reason": "--smoke"}, []
        return self._part_py("first_step", "first_step", self.work / "first_step.json",
                             deadline, rest=["--config", RECIPE,
                                             *self._grpo_overrides("bfloat16", 1)])

    def drafter(self, deadline):
        if self.smoke:
            return "skipped", {"reason": "--smoke"}, []
        return self._part_py("drafter", "drafter", self.work / "drafter.json", deadline,
                             ["--steps", "3", "--new-tokens", "8"] if self.dry else [])

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
        return _status(all(c["rc"] == 0 for c in cmds), cmds), res, cmds

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
        return _status(c["rc"] == 0 and bool(full), [c]), res, [c]

    # ------------------------------------------------------------------ the summary
    def summary(self, parts: dict, final: bool) -> dict:
        ran = [p for p in parts.values() if p["status"] != "running"]
        return {"mode": "smoke" if self.smoke else "dry" if self.dry else "gpu",
                "date": str(date.today()), "finished": final,
                # every part that ran passed (an incomplete tests_gpu: no failure so far)
                "passed": not self.stopped and all(
                    p["status"] in ("passed", "skipped", "incomplete") for p in ran),
                # nothing was cut short or left out for want of time
                "complete": final and not self.stopped and not self.cut_short(parts),
                "plan": {k: {"cap_s": v[0], "min_s": v[1]} for k, v in self.plan.items()},
                "device": self.probe.get("device"), "fp8": self.probe.get("fp8"),
                "transformer_engine": self.te_available(), "wheels": str(self.wheels),
                "wheel_folder_problems": self.folder_problems,
                "files": sorted(p.name for p in self.out.iterdir() if p.is_file()),
                "notes": NOTES, "parts": parts}

    @staticmethod
    def cut_short(parts: dict) -> list[str]:
        """Parts that time cut short or left out (tests_gpu not, where tests_gpu_rest ran
        every test it left)."""
        cut = [n for n, p in parts.items() if p["status"] in ("timeout", "incomplete")
               or p.get("timed_out") or p.get("no_time_left")]
        if parts.get("tests_gpu_rest", {}).get("status") == "passed":
            cut = [n for n in cut if n != "tests_gpu"]
        return cut

    def selected(self) -> list[str]:
        """The parts to run: all, or ``--parts`` plus the install and the assets that
        every later part needs."""
        if not self.args.parts:
            return list(self.plan)
        want = set(self.args.parts)
        if want - {"install"}:
            want.add("install")
        if want - {"install", "assets"}:
            want.add("assets")
        return [p for p in self.plan if p in want]

    def main(self) -> int:
        sched = Schedule(self.args.deadline, self.out, self.summary, self.log_path)
        log(f"results in {self.out}, work folder {self.work}, deadline "
            f"{self.args.deadline:.0f} s")
        # the folder first: a missing wheel or shape file would fail half the parts
        self.folder_problems = folder_problems(self.wheels)
        for problem in self.folder_problems:
            log(f"wheel folder: {problem}")
        if self.folder_problems and not self.args.allow_incomplete_wheels:
            self.stopped = True
            sched.write(final=True)
            log(f"FAILED before any part: the wheel folder {self.wheels} is incomplete "
                "(above: what is missing and how to make it; --allow-incomplete-wheels "
                "runs the parts anyway)")
            return 2
        for name in self.selected():
            cap, least = self.plan[name]
            sched.run(Part(name, getattr(self, name), cap, least))
        s = sched.write(final=True)
        for name, p in s["parts"].items():
            log(f"{name:15s} {p['status']:10s} {p['seconds']:6.1f} s (limit {p['limit_s']:.0f})")
        log(f"total {s['elapsed_s']:.1f} s of {s['deadline_s']:.0f}; "
            f"{'PASSED' if s['passed'] else 'FAILED'}"
            f"{'' if s['complete'] else ' (incomplete: see skipped or timed-out parts)'}")
        return 0 if s["passed"] and s["complete"] else 1


def _status(ok, cmds: list) -> str:
    """A part's status from its commands: failed when one of them failed by itself; else
    ``timeout`` when one was cut at the part's time limit (what it did not finish is
    missing, not wrong); passed when ``ok``."""
    if ok:
        return "passed"
    if any(c.get("rc") not in (0, None) and not c.get("timed_out") for c in cmds):
        return "failed"
    return "timeout" if any(c.get("timed_out") for c in cmds) else "failed"


def default_out(dry: bool) -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    if dry:
        return Path(tempfile.gettempdir()) / "gpu_check_dry"
    return REPO / "docs" / "results" / f"gpu_check_{date.today()}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", default=bool(os.environ.get("GPU_CHECK_DRY")),
                    help="CPU: every part with the GPU steps stubbed (also GPU_CHECK_DRY=1)")
    ap.add_argument("--smoke", action="store_true",
                    help="--dry, GRPO validated by --dry-run only, no benches (CI)")
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help="wall seconds for the whole check, from its start (default 540)")
    ap.add_argument("--per-test", type=float, default=PER_TEST_S,
                    help="seconds one tests_gpu test may take before it is killed")
    ap.add_argument("--tests-after", default=None, metavar="JSONL",
                    help="a previous call's tests_gpu.jsonl: run only the tests it did not "
                         "finish")
    ap.add_argument("--wheels", default=str(WHEELS), help="the wheel folder")
    ap.add_argument("--allow-incomplete-wheels", action="store_true",
                    help="run the parts even when the wheel folder lacks a pinned wheel or "
                    "SmolLM2's shape files (default: stop before the first part and say "
                    "what is missing)")
    ap.add_argument("--out", default=None, help="results folder (default: $OUT, else "
                    "docs/results/gpu_check_<date>/, dry: a temporary folder)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--parts", nargs="*", default=None, choices=list(PLAN),
                    help="run only these (with install and assets, which they need)")
    ap.add_argument("--cap", nargs="*", default=[], metavar="PART=SECONDS",
                    help="change a part's cap")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.out = args.out or str(default_out(args.dry or args.smoke))
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
