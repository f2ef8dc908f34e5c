"""Services the kernels and the runtime both use: platform discovery, build keys, the artifact
store, fault drills and bounded waits. They import nothing from ``kernels``, ``runtime`` or
``vllm_plugin`` (the import contract in ``pyproject.toml`` holds this)."""
