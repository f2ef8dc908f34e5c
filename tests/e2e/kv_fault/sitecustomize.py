"""Test-only fault: mono decode reads vLLM's CPU KV cache with the wrong K layout, and the
plugin's start-up comparison with vLLM's own layers is skipped so the fault reaches serving.

tests/e2e puts this directory on ``PYTHONPATH`` of one ``vllm serve`` together with
``MONODECODE_E2E_KV_FAULT=k_row_major``; Python imports ``sitecustomize`` at the start of every
process of that server (API server, engine core, worker). When the plugin's modules are imported:

- ``cpu_kv.block_interiors`` addresses K with V's row-major block interior instead of the
  column-major one ``CPU_ATTN`` writes: the kernels read the keys the stock prefill stored as
  garbage (and their own writes through the same wrong view);
- ``stock.stock_check`` (the start-up check that the kernels match vLLM's layers on vLLM's KV
  layout, which catches exactly this) reports no problem, as a check that missed the defect would.

So the end-to-end re-scoring check must catch the defect on its own. Without the variable nothing
is changed.
"""

import importlib.abc
import importlib.util
import os
import sys


def _wrong_k_layout(module) -> None:
    right = module.block_interiors

    def block_interiors(isa, block_size, head_dim, dtype):
        _, value = right(isa, block_size, head_dim, dtype)
        return value, value

    module.block_interiors = block_interiors


def _stock_check_misses(module) -> None:
    module.stock_check = lambda *args, **kwargs: None


PATCHES = {
    "monodecode.vllm_plugin.cpu_kv": _wrong_k_layout,
    "monodecode.vllm_plugin.stock": _stock_check_misses,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)  # the module's own spec, found without this finder
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)
            print(f"kv_fault: patched {name} (test fault k_row_major)", file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MONODECODE_E2E_KV_FAULT") == "k_row_major":
    sys.meta_path.insert(0, _PatchOnImport())
