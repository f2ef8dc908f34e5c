"""The embedded tiny model: files HF can load, a real tokenizer, determinism, atomic generation,
and greedy decoding that matches transformers and depends on the prompt.

Tolerance: the reference's bf16 logits against HF-fp32 on the same tokens within 0.2 (logits reach
|14|; measured ~0.1, the same as HF-bf16's own error against HF-fp32).
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch

from monodecode.errors import MonodecodeError
from monodecode.model import ensure_tiny_model, greedy_decode, load_dims
from monodecode.model.profiles import TINY_CONFIG, profile_dims
from monodecode.model.tiny import DIR_NAME

pytestmark = pytest.mark.usefixtures("torch_one_thread")

transformers = pytest.importorskip("transformers")

TOL = 0.2
PROMPTS = ["Hello world", "The quick brown fox", "What is the weather today?", "0 1 2 3"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return transformers.AutoTokenizer.from_pretrained(tiny)


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_files_and_config(tiny):
    names = {p.name for p in tiny.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    assert json.loads((tiny / "config.json").read_text()) == json.loads(json.dumps(TINY_CONFIG))
    assert load_dims(tiny) == profile_dims("tiny")
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (2, 1, 0)


def test_hf_loads_every_tensor(tiny):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.sliding_window == 24 and model.config.layer_types[3] == "full_attention"


def test_tokenizer(tokenizer):
    assert len(tokenizer) == 512
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>", "<bos>", "<unk>")}
    assert ids == {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 1, 0)
    for text in ["Hello world", "héllo ✓ über 日本", "  spaces\tand\nnewlines  "]:
        enc = tokenizer(text)["input_ids"]
        assert enc[0] == 2 and 3 not in enc  # BOS first; byte-level: nothing is unknown
        assert tokenizer.decode(enc, skip_special_tokens=True) == text
    assert len(tokenizer("The quick brown fox")["input_ids"]) < 1 + len("The quick brown fox")  # merges work
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    chat_ids = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert chat_ids[0] == 2 and chat_ids.count(2) == 1
    assert tokenizer.decode(chat_ids) == "<bos>user: hi\nassistant: "
    # Every id the model can emit maps to a token (a detokenizer never meets a hole).
    assert all(t is not None for t in tokenizer.convert_ids_to_tokens(list(range(512))))


def test_generation_is_deterministic_and_idempotent(tiny, tmp_path):
    again = ensure_tiny_model(tmp_path)
    assert again == tmp_path / DIR_NAME and _digests(again) == _digests(tiny)
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [DIR_NAME]  # no temporary directories left


def test_stale_directory_is_replaced(tiny, tmp_path):
    stale = tmp_path / DIR_NAME
    stale.mkdir()
    (stale / "config.json").write_text("{half written")
    (stale / "monodecode-tiny.json").write_text('{"version": 0}')
    assert ensure_tiny_model(tmp_path) == stale
    assert _digests(stale) == _digests(tiny)
    assert [p.name for p in tmp_path.iterdir()] == [DIR_NAME]


def test_concurrent_callers_get_one_complete_model(tiny, tmp_path):
    results, errors = [], []

    def call():
        try:
            results.append(ensure_tiny_model(tmp_path))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and set(results) == {tmp_path / DIR_NAME}
    assert _digests(tmp_path / DIR_NAME) == _digests(tiny)
    assert [p.name for p in tmp_path.iterdir()] == [DIR_NAME]


def test_default_directory(monkeypatch, tmp_path, tiny):
    monkeypatch.setenv("MONODECODE_CACHE_DIR", str(tmp_path / "c"))
    assert ensure_tiny_model() == tmp_path / "c" / "models" / DIR_NAME
    monkeypatch.delenv("MONODECODE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ensure_tiny_model() == tmp_path / "home" / ".cache" / "monodecode" / "models" / DIR_NAME


def test_unwritable_cache_dir_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(MonodecodeError) as e:
        ensure_tiny_model(blocker / "sub")
    assert "tiny model: cannot create a directory under" in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def hf32(tiny):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def continuations(tiny, tokenizer):
    return {p: greedy_decode(tiny, tokenizer(p)["input_ids"], 12) for p in PROMPTS}


def test_greedy_decode_matches_transformers(tokenizer, hf32, continuations):
    for prompt, (out, last) in continuations.items():
        ids = tokenizer(prompt)["input_ids"]
        assert len(out) == 12 and last.dtype == torch.float32 and last.shape == (512,)
        assert int(last.argmax()) == out[-1]
        with torch.no_grad():
            hf = hf32(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].float()
        for step, tok in enumerate(out):
            want = int(hf[step].argmax())
            assert tok == want or float(hf[step, want] - hf[step, tok]) < TOL, f"{prompt!r} step {step}"
        assert float((last - hf[-1]).abs().max()) <= TOL


def test_greedy_decode_depends_on_the_prompt(continuations):
    outs = [tuple(out) for out, _ in continuations.values()]
    assert len(set(outs)) == len(outs)
    assert all(len(set(o)) >= 3 for o in outs), outs  # no continuation is one token repeated
    assert len(set().union(*outs)) >= 20, outs


def test_greedy_decode_block_size_does_not_change_tokens(tiny, tokenizer, continuations):
    ids = tokenizer(PROMPTS[2])["input_ids"]
    out, last = greedy_decode(tiny, ids, 12, block_size=4)
    ref_out, ref_last = continuations[PROMPTS[2]]
    assert out == ref_out and float((last - ref_last).abs().max()) < 0.1


def test_greedy_decode_bad_input(tiny):
    with pytest.raises(MonodecodeError, match="max_new_tokens must be >= 1"):
        greedy_decode(tiny, [2, 5], 0)
    with pytest.raises(MonodecodeError, match="at least one prompt token"):
        greedy_decode(tiny, [], 3)
    with pytest.raises(MonodecodeError, match="token id 512 is outside the vocabulary"):
        greedy_decode(tiny, [2, 512], 3)
