"""Test-only fault: mono decode reads vLLM's CPU KV cache with the wrong K layout.

tests/e2e puts this directory on ``PYTHONPATH`` of one ``vllm serve`` together with
``MONODECODE_E2E_KV_FAULT=k_row_major``; Python imports ``sitecustomize`` at the start of every
process of that server (API server, engine core, worker). Once the plugin's CPU KV module is
imported, its ``block_interiors`` is wrapped so K is addressed with V's row-major block interior
instead of the column-major one ``CPU_ATTN`` writes: the kernels then read the keys the stock
prefill stored as garbage (and their own writes through the same wrong view), which is the
defect the end-to-end re-scoring check must catch. Without the variable nothing is changed.
"""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "monodecode.vllm_plugin.cpu_kv"


def _patch(module) -> None:
    right = module.block_interiors

    def wrong_k_layout(isa, block_size, head_dim, dtype):
        _, value = right(isa, block_size, head_dim, dtype)
        return value, value

    module.block_interiors = wrong_k_layout
    print(f"kv_fault: {TARGET}.block_interiors reads K row-major (test fault)", file=sys.stderr, flush=True)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MONODECODE_E2E_KV_FAULT") == "k_row_major":
    sys.meta_path.insert(0, _PatchOnImport())
