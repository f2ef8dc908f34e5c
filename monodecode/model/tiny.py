"""The embedded default model: a tiny Gemma-3-style decoder generated on demand in HF format.

``ensure_tiny_model()`` writes, once, into a cache directory:

- ``config.json``: ``profiles.TINY_CONFIG`` (Gemma3ForCausalLM, 4 layers, hidden 256, vocab 512);
- ``model.safetensors``: seeded random bf16 weights under HF Gemma3ForCausalLM tensor names (tied LM head);
- ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``: a byte-level BPE
  tokenizer with exactly 512 tokens (4 specials, 256 bytes, 252 merges learned deterministically
  from an embedded text), loadable by transformers' ``AutoTokenizer`` and therefore by vLLM;
- ``generation_config.json``, and ``monodecode-tiny.json`` (what generated the directory).

Everything is deterministic: two generations give byte-identical files. The directory appears
atomically (built in a temporary sibling, then renamed), so a reader never sees a partial model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch

from monodecode.errors import MonodecodeError
from monodecode.model.dims import dims_from_hf_config
from monodecode.model.profiles import TINY_CONFIG

# Bump when anything that shapes the generated files changes; an older directory is replaced.
GENERATOR_VERSION = 2
SEED = 20250611
DIR_NAME = "tiny-gemma3"

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, BOS, UNK]  # ids 0..3, matching TINY_CONFIG's pad/eos/bos ids

# Text the tokenizer's merges are learned from (written for this project).
_CORPUS = """
The quick brown fox jumps over the lazy dog while the model decodes one token at a time.
A decode step reads every weight of every layer once, so the time of a step is set by memory
bandwidth, not by arithmetic. The megakernel keeps each layer in two persistent launches: the first
one normalizes the residual stream, projects the query, key and value, rotates them, writes the new
key and value into the paged cache and attends over the context; the second one projects the output,
adds the residual, and runs the gated feed forward network. Operators install the chart, watch the
metrics, and get paged when decoding falls back or stops. Hello world, this is a tiny model that
speaks in random tokens. It has four layers, a small vocabulary, and a sliding window of attention.
Numbers such as 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in text too, and so do questions: what is
the weather today? Where is the nearest station? How many blocks does the cache hold? The answer
depends on the block size and on the length of the sequence. Thank you for reading this text.
"""


_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def default_cache_dir() -> Path:
    root = os.environ.get("MONODECODE_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "monodecode"
    return base / "models"


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest to code points >= 256."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _learn_merges(words: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair)."""
    counts = Counter(words)
    seqs = {w: list(w) for w in counts}
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges:
        pairs: Counter = Counter()
        for w, n in counts.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            raise MonodecodeError("tiny tokenizer: corpus too small for the requested merges")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        joined = best[0] + best[1]
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == best[0] and s[i + 1] == best[1]:
                    out.append(joined)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_tokenizer(vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` tokens; prepends BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[alphabet[b]] = len(vocab)
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = [w for w, _ in pre.pre_tokenize_str(_CORPUS)]
    merges = _learn_merges(words, vocab_size - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if len(vocab) != vocab_size:
        raise MonodecodeError(f"tiny tokenizer: built {len(vocab)} tokens, config says {vocab_size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return tok


# ---------------------------------------------------------------------------------------------
# Weights


def tiny_state_dict(config: dict | None = None, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Seeded random bf16 tensors under HF Gemma3ForCausalLM names (LM head tied to the embedding).

    Scales are chosen so greedy decoding depends on the context instead of copying the current
    token (the tied LM head favours the input token's own embedding) or falling into one fixed
    token: a small embedding (x sqrt(hidden) = 0.8 RMS) next to post-norm-scaled layer updates, and
    a final norm whose ``1 + w`` is centred on 0 with a wide spread, which removes the self-copy
    bias and spreads the logits over several units (clear argmax margins).
    """
    dims = dims_from_hf_config(config or TINY_CONFIG)
    g = torch.Generator().manual_seed(seed)
    h, q, kv, inter = dims.hidden_size, dims.q_size, dims.kv_size, dims.intermediate_size

    def mat(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) / inp**0.5

    def norm(size: int, mean: float = 0.0) -> torch.Tensor:
        return mean + 0.1 * torch.randn(size, generator=g)  # Gemma's (1 + w): w ~ 0 is the identity

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(dims.vocab_size, h, generator=g) * 0.05}
    for l in range(dims.num_layers):
        p = f"model.layers.{l}."
        sd[p + "input_layernorm.weight"] = norm(h)
        sd[p + "self_attn.q_proj.weight"] = mat(q, h)
        sd[p + "self_attn.k_proj.weight"] = mat(kv, h)
        sd[p + "self_attn.v_proj.weight"] = mat(kv, h)
        sd[p + "self_attn.q_norm.weight"] = norm(dims.head_dim)
        sd[p + "self_attn.k_norm.weight"] = norm(dims.head_dim)
        sd[p + "self_attn.o_proj.weight"] = mat(h, q)
        # Post norms below 1 keep each layer's update a fraction of the residual stream.
        sd[p + "post_attention_layernorm.weight"] = norm(h, -0.5)
        sd[p + "pre_feedforward_layernorm.weight"] = norm(h)
        sd[p + "mlp.gate_proj.weight"] = mat(inter, h)
        sd[p + "mlp.up_proj.weight"] = mat(inter, h)
        sd[p + "mlp.down_proj.weight"] = mat(h, inter)
        sd[p + "post_feedforward_layernorm.weight"] = norm(h, -0.5)
    sd["model.norm.weight"] = -1.0 + 4.0 * torch.randn(h, generator=g)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}


# ---------------------------------------------------------------------------------------------
# The directory


def _stamp() -> dict:
    return {"generator": "monodecode.model.tiny", "version": GENERATOR_VERSION, "seed": SEED}


def _is_complete(path: Path) -> bool:
    try:
        return json.loads((path / "monodecode-tiny.json").read_text()) == _stamp()
    except (OSError, ValueError):
        return False


def _write_model(out: Path) -> None:
    from safetensors.torch import save_file

    config = dict(TINY_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    save_file(tiny_state_dict(config), str(out / "model.safetensors"), metadata={"format": "pt"})

    tok = build_tokenizer(config["vocab_size"])
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        # A plain template so chat endpoints (vLLM's /v1/chat/completions) work with the demo model.
        "chat_template": _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n")
    # Written last: its presence with the right content marks a complete directory.
    (out / "monodecode-tiny.json").write_text(json.dumps(_stamp(), indent=2, sort_keys=True) + "\n")


def ensure_tiny_model(cache_dir: str | Path | None = None) -> Path:
    """Return the tiny model's directory, generating it first if needed.

    ``cache_dir`` is the parent directory (default ``$MONODECODE_CACHE_DIR/models``, else
    ``~/.cache/monodecode/models``); the model lives in ``<cache_dir>/tiny-gemma3``. Safe to call
    from several processes at once: each builds in its own temporary directory and the first
    rename wins.
    """
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = parent / DIR_NAME
    if _is_complete(final):
        return final
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}.", dir=parent))
    except OSError as e:
        raise MonodecodeError(f"tiny model: cannot create a directory under {parent}: {e.strerror}") from None
    try:
        _write_model(tmp)
        os.chmod(tmp, 0o755)
        if final.exists() and not _is_complete(final):
            # Stale or foreign content from an older generator: move it aside, then replace it.
            stale = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}.old.", dir=parent))
            os.rename(final, stale / DIR_NAME)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # lost a race only if the winner left a complete model
                raise
    except OSError as e:
        raise MonodecodeError(f"tiny model: cannot write {final}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
