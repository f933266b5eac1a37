"""Triton kernels, installed as ``rlvr_fast.kernels``.

One module per op (``kernels/<op>.py``), each with its pure-PyTorch reference beside the kernel;
the public wrappers live in ``rlvr_fast/ops``. Kernels run on CUDA, and under
``TRITON_INTERPRET=1`` on CPU tensors in the test suite.
"""
