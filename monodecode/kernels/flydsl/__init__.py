"""Persistent decode kernels (K1/K2) for AMD Instinct gfx942 / gfx950 in FlyDSL, baked ahead of time.

The same shape as ``kernels/triton``, module for module:

* ``backend``: the ``flydsl`` KernelBackend (refusals, build key, artifact lookup, build);
* ``launch``: host side (packed weights, RoPE tables, scratch buffer, launches); ``args``: the
  launch argument order and one launch's arguments and stream;
* ``config``: launch configuration, the shared plan as the kernels bake it (tiles, LDS, regions);
* ``mailbox``: the hand-off protocol (tagged words, bounded waits, launch epoch, health word);
* ``gemv``, ``attention``: the stages; ``k1``, ``k2``: the two kernels and their launchers;
* ``offline``: compile without a GPU (subprocess), ``isa``: resource budgets of the code objects.

FlyDSL-only: ``arch`` (CDNA facts), ``device`` (device primitives), ``kv`` (KV cache addressing),
``bake`` (precompiled artifacts and the run-only cache), ``toolchain`` (ROCm root, per-arch env).
Importing this package imports nothing heavy: FlyDSL is imported only by the kernel modules.
"""
