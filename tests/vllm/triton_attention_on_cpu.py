"""Run a ROCm serve pair's attention on this CPU machine, under Triton's interpreter, and bind a
mono model to it as on an AMD node: prints one ``RESULT {json}`` line. The backend is
``MONODECODE_TEST_ATTENTION`` (default ``TRITON_ATTN``; ``ROCM_AITER_UNIFIED_ATTN``: AITER's own
Triton kernel, with AITER on, aiter_on_cpu.py), with the environment ``serve_settings`` gives its pair.

    python triton_attention_on_cpu.py bind MODEL_DIR TMP_DIR [FAULT]
    python triton_attention_on_cpu.py bind_each MODEL_DIR TMP_DIR none|FAULT...
    python triton_attention_on_cpu.py generate MODEL_DIR TMP_DIR mono|stock [FAULT]
    python triton_attention_on_cpu.py score MODEL_DIR TMP_DIR SEQUENCES_JSON

``bind``: vLLM's loader and KV binding driven by hand (``vllm_testlib``), the plugin's state after
binding. ``generate``: a real in-process vLLM engine (``LLM``: scheduler, model runner, worker)
serves greedy continuations of ``PROMPTS`` with mono decode on or off, with their logprobs and
the step counts. ``score``: a stock engine's prompt logprobs of each token sequence in the file,
the reference the continuations are re-scored against (tests/e2e/rescore.py).

What stands in for the GPU, and nothing else:

- Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors; vLLM, which
  disables Triton when no GPU driver is active, is handed the real ``triton`` modules;
- the interpreter's ``tl.dot`` multiplies bf16 operands as the raw 16-bit integers it stores them
  in (Triton 3.6 to 3.9); they are widened to fp32 first, as the GPU's dot does;
- ``torch.cuda.get_device_capability`` answers (9, 4), what torch reports for gfx942, where vLLM's
  cache writer asks;
- vLLM's CPU platform selects the backend, as ROCm's selection does for ``--attention-backend``
  (the image's setting);
- with AITER's attention, AITER's (16, 16) preshuffle of layer 1's ``o_proj`` (``AITER_SHUFFLED``):
  AITER's own ``shuffle_weight`` rearranges the weight vLLM loaded and marks the layer
  (``aiter_bpreshuffled``, vLLM's marker for it), and the layer's GEMM reads it through AITER's own
  permutation (AITER's HIP GEMMs cannot run here);
- the plugin detects an MI300X whose GPU torch cannot launch on, so its runner decodes with the
  reference backend on the bound cache (what it does on a node with a CPU build of torch).

vLLM's attention class, metadata builder, cache writer and Triton kernels, its layout resolution,
model classes and loader are its own. ``FAULT`` (``bind``; ``generate`` takes ``o_proj_tiles``,
applied once the engine has started, a kernel going wrong after warm-up; ``bind`` also takes
``slow_width_2``: no fault, the kernels are a fake that is slow at width 2, for the width policy's
timing against vLLM's Triton layers at contexts up to ``max_model_len`` 32, one replay a step):
``o_proj_tiles`` (the kernels read o_proj's
16 x 16 tiles transposed: an AITER-preshuffled matrix read row-major) or ``kv_swapped`` (the
kernels read V where K is), or ``vllm_layer_raises`` (vLLM's layer cannot run: the comparison is
skipped with a warning, the kernels keep serving on their golden check), or ``preshuffle_unseen``
(the plugin does not see AITER's shuffle and reads the shuffled bytes row-major), or ``backend=NAME``
(vLLM selects the backend ``NAME`` of a pair with the same environment). Run as a subprocess: the interpreter must be on before vLLM's Triton
modules are first imported.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _interpreter_dot_widens_bf16() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widened(t):
            if t.dtype.scalar != tl.bfloat16:
                return t
            wide = (t.data.astype(np.uint32) << 16).view(np.float32)  # bf16 is fp32's upper half
            return interpreter.TensorHandle(wide, tl.float32)

        return plain(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot


ATTENTION = os.environ.get("MONODECODE_TEST_ATTENTION", "TRITON_ATTN")
_SELECTED = [ATTENTION]  # the backend vLLM's CPU platform selects; ``backend=NAME`` switches it
AITER_SHUFFLED = "model.layers.1.self_attn.o_proj"


def enable() -> None:
    import torch
    import triton
    import triton.language as tl

    from monodecode.kernels.triton.interpret import skip_nested_lang_patches
    from monodecode.vllm_plugin.serving import serve_settings

    os.environ.update(serve_settings("rocm", ATTENTION).env)
    _interpreter_dot_widens_bf16()
    skip_nested_lang_patches()
    import vllm.triton_utils as triton_utils

    triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True
    torch.cuda.get_device_capability = lambda device=None: (9, 4)

    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if ATTENTION.startswith("ROCM_AITER"):
        from aiter_on_cpu import enable_aiter_attention, preshuffle_with_aiter

        enable_aiter_attention()
        preshuffle_with_aiter(AITER_SHUFFLED)
    CpuPlatform.get_attn_backend_cls = classmethod(lambda cls, *a, **k: AttentionBackendEnum[_SELECTED[0]].get_path())

    from monodecode.services.platform import Platform
    from monodecode.vllm_plugin import decode

    mi300x = Platform(kind="rocm", arch="gfx942", name="AMD Instinct MI300X", compute_units=304, source="kfd")
    decode.detect_platform = lambda device=None: mi300x


def _fault_before_load(name: str):
    """Apply a fault that acts while the model loads; returns what undoes it."""
    if name == "preshuffle_unseen":
        from monodecode.vllm_plugin import weights

        seen = weights.preshuffled
        weights.preshuffled = lambda module: False
        return lambda: setattr(weights, "preshuffled", seen)
    if name.startswith("backend="):  # another backend of the same pair environment (AITER's two)
        from vllm.v1.attention.selector import _cached_get_attn_backend

        from monodecode.vllm_plugin.serving import serve_settings

        def select(backend: str) -> None:
            _SELECTED[0] = backend
            _cached_get_attn_backend.cache_clear()  # vLLM's selector remembers its last answer

        other = name.removeprefix("backend=")
        assert serve_settings("rocm", other).env == serve_settings("rocm", ATTENTION).env, other
        select(other)
        return lambda: select(ATTENTION)
    return lambda: None


def _fault(model, name: str) -> None:
    from monodecode.model.paged_kv import PagedKVCache
    from monodecode.model.weights import Linear
    from monodecode.vllm_plugin import stock

    if name == "o_proj_tiles":
        lw = model.mono.runner._weights.layers[1]
        w = lw.o_proj.weight
        out, inp = w.shape
        tiles = w.reshape(out // 16, 16, inp // 16, 16).transpose(1, 3).reshape(out, inp).contiguous()
        lw.o_proj = Linear(tiles, lw.o_proj.scale)
    elif name == "kv_swapped":
        views = stock.kv_views

        def swapped(*args, **kwargs):
            kv = views(*args, **kwargs)
            return PagedKVCache(key=kv.value, value=kv.key, block_size=kv.block_size)

        stock.kv_views = swapped
    elif name == "vllm_layer_raises":

        def raises(*args, **kwargs):
            raise RuntimeError("HIP error: invalid device function\n(the rest of a ROCm error)")

        stock.VllmStockLayer.run = raises
    elif name and name not in (SLOW_WIDTH, "preshuffle_unseen") and not name.startswith("backend="):
        raise SystemExit(f"unknown fault {name!r}")


SLOW_WIDTH = "slow_width_2"  # not a fault: the kernels are a fake that is slow at width 2 (width policy)


def _options(tmp: str, fault: str) -> dict:
    from vllm_testlib import mono_options

    options = mono_options(Path(tmp), on_refusal="degrade")
    if fault == SLOW_WIDTH:
        sys.path.insert(0, str(Path(__file__).parents[1]))
        from fake_backends import SlowAtTwo, SlowAtTwoBackend, register

        # vLLM's interpreted Triton layers take 0.3 s (AVX-512 host) to 1.5 s (a slower AVX2 host) each
        # at width 2: 5 s loses by 3x on either, and only one such step is timed (the longest context)
        SlowAtTwo.delay_s = 5.0
        register(SlowAtTwoBackend)
        from monodecode.runtime import width_policy

        width_policy.BUDGET_S = 0.5  # interpreted steps take ~0.5 s: one replay of each is enough here
        width_policy.TOTAL_BUDGET_S = 900.0  # every pair is reached, however slow the host
        options.update(backend=SlowAtTwoBackend.name, widths=[1, 2])
    return options


def bind(model_dir: str, tmp: str, fault: str = "") -> dict:
    import torch
    from vllm_testlib import bind_vllm_kv, engine_config, init_one_rank, load_model

    from monodecode.vllm_plugin.binding import layer_backend

    if not _STARTED:
        torch.set_num_threads(1)
        init_one_rank()
        _STARTED.append(True)
    import vllm._custom_ops  # noqa: F401  (loads vllm._C where the wheel has it)

    extra = {}
    if not hasattr(torch.ops._C, "rotary_embedding"):
        # the CUDA wheel on CPU has no compiled rotary / norm kernels: vLLM's own native forms
        extra["compilation_config"] = {"custom_ops": ["none"]}
    if fault == SLOW_WIDTH:
        extra["max_model_len"] = 32  # contexts 7, 15, 31: the interpreted attention is slow
    cfg = engine_config(Path(model_dir), additional_config={"monodecode": _options(tmp, fault)}, **extra)
    undo = _fault_before_load(fault)
    model = load_model(cfg)
    undo()
    mono = model.mono
    built = {"state": mono.state, "reasons": list(mono.reasons)}
    _fault(model, fault)
    bind_vllm_kv(model, cfg)
    return {
        "backend": layer_backend(model.model.layers[0].self_attn.attn),
        "layout": cfg.cache_config.kv_cache_layout,
        "platform": mono.platform.label,
        "built": built,
        "state": mono.state,
        "reasons": list(mono.reasons),
        "compared_with_vllm": mono.vllm_agreement is not None,
        "in_place": _in_place(mono),
        "widths": mono.runner.summary()["widths"],
        "weight_copy_bytes": mono.weight_copy_bytes,
    }


_STARTED: list[bool] = []  # vLLM's distributed state, made once per process


def bind_each(model_dir: str, tmp: str, *faults: str) -> dict:
    """``bind`` once per fault ("none": no fault) in this process, each on a fresh model (one
    interpreter and vLLM start-up for them all). Faults applied after loading stay applied."""
    return {"runs": [bind(model_dir, f"{tmp}/{i}", "" if f == "none" else f) for i, f in enumerate(faults)]}


def _in_place(mono) -> bool:
    """The kernels read vLLM's cache in place (the GPU binding), not staged per step."""
    return mono._binding is not None and mono._binding.kv is not None


PROMPTS = [[2, 17, 301, 45, 9], [2, 88, 7, 410, 12, 5, 61], [2, 250], [2, 33, 33, 90, 128, 7]]
NEW_TOKENS = 12


def _engine(model_dir: str, tmp: str, mono: bool):
    from vllm_testlib import in_process_engine, mono_options

    options = mono_options(Path(tmp), on_refusal="raise", widths=[1, 2, 4]) if mono else None
    llm, model_runner = in_process_engine(model_dir, options)
    return llm, model_runner.model


def generate(model_dir: str, tmp: str, which: str, fault: str = "") -> dict:
    from vllm import SamplingParams

    from monodecode.vllm_plugin.binding import layer_backend

    llm, model = _engine(model_dir, tmp, which == "mono")
    _fault(model, fault)
    mono = getattr(model, "mono", None)
    before = (mono.runner.steps, mono.runner.mono_steps) if mono else (0, 0)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    conts = []
    for p, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        conts.append(
            {
                "prompt_ids": p,
                "token_ids": list(c.token_ids),
                "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
            }
        )
    result = {"backend": layer_backend(model.model.layers[0].self_attn.attn), "continuations": conts}
    if mono:
        result.update(
            state=mono.state,
            reasons=list(mono.reasons),
            in_place=_in_place(mono),
            compared_with_vllm=mono.vllm_agreement is not None,
            weight_copy_bytes=mono.weight_copy_bytes,
            steps=mono.runner.steps - before[0],
            mono_steps=mono.runner.mono_steps - before[1],
        )
    return result


def score(model_dir: str, tmp: str, sequences_file: str) -> dict:
    from vllm import SamplingParams

    sequences = json.loads(Path(sequences_file).read_text())
    llm, _ = _engine(model_dir, tmp, mono=False)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return {
        "prompt_logprobs": [
            [{t: lp.logprob for t, lp in (entry or {}).items()} for entry in out.prompt_logprobs] for out in outs
        ]
    }


MODES = {"bind": bind, "bind_each": bind_each, "generate": generate, "score": score}


def main(mode: str, *args: str) -> None:
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # vllm_testlib, aiter_sources
    enable()
    print("RESULT " + json.dumps(MODES[mode](*args)))


if __name__ == "__main__":
    main(*sys.argv[1:])
