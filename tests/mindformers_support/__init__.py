"""CPU/test-only workarounds that let MindFormers 2.0.0 from PyPI train on this project's CPU machines.

Never part of the product (trainer/ does not import this package):
- `hyper_parallel_stub`: MindFormers 2.0.0 requires `hyper-parallel`, which is not on PyPI; its imports of it
  serve PyNative and distributed-checkpoint paths a CPU graph-mode job does not take.
- `cpu_patches`: MindFormers' train cells check loss-scale overflow with NPU-only kernels
  (NPUGetFloatStatusV2) unless the target is GPU; on CPU they take MindSpore's GPU path (isfinite of the
  gradients, all-reduced), which CPU kernels serve.
- `run_mindformer_cpu.py`: applies both, then runs a MindFormers runner script (run_mindformer.py from a
  MindFormers checkout, or `train_runner.py` here when none is at hand: the wheel ships no runner).
"""
