"""monodecode: decode megakernels ("mono decode") for dense transformers served by vLLM.

The runtime package. It never imports Docker, Helm or Typer (those live in ``monodecode_ops``),
and imports vLLM only under ``monodecode.vllm_plugin``.
"""

__version__ = "0.1.0"
