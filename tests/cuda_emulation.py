"""CPU stand-ins for the CUDA paths that only a GPU runs: a graph runtime for ``DecodeGraphs`` and
a guard that fails on host syncs.

``EmulatedCuda`` has the part of ``torch.cuda`` that ``rlvr_fast.engine.cuda_graphs`` uses
(``CUDAGraph``, ``graph``, ``Stream``, ``stream``, ``current_stream``, ``device``). A
capture records every ATen operation the captured code dispatches and every Triton kernel it
launches (under TRITON_INTERPRET=1), with the very tensors it was given and the ones it made;
``replay`` runs them again, in order, writing each ATen result into the tensor the capture made
and launching each kernel with its captured arguments, so that, as on a GPU, a replay reads the
static input buffers as they are now and writes the same output and KV-cache memory, with every
Python-side value (a shape, a stride, a scalar, a branch taken) frozen at capture. Code that reads
a tensor on the host during capture fails there, as CUDA's stream capture does. What it cannot
see: pybind C++ calls (the CPU kernels of ``rlvr_fast._C``), so graph tests run in bf16, where
the model takes no C++ path, as on CUDA.

``no_host_sync`` raises ``HostSyncError`` on every operation that makes a CUDA stream wait for the
host: a scalar read (``.item()``, ``bool(t)``), a copy to the host (``.tolist()``, ``.numpy()``,
``.cpu()``: seen as calls, since on a CPU tensor they dispatch nothing), or an output whose size
depends on the data (``nonzero``, ``masked_select``, ``unique``, boolean indexing,
``repeat_interleave`` by a tensor).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # no Triton: only ATen operations are captured
    InterpretedFunction = None

aten = torch.ops.aten

# Operations whose result is a host value, or whose output size depends on tensor data.
HOST_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.allclose.default,
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten._unique.default,
    aten._unique2.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
    aten.repeat_interleave.self_Tensor,
}
# Host data copied into the graph (torch.tensor(...) inside a captured step).
HOST_DATA_OPS = {aten.lift_fresh.default}
# Copies to the host, which on a CPU tensor dispatch no operation.
HOST_COPY_METHODS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}


class HostSyncError(RuntimeError):
    """A captured step read a device tensor on the host or made a data-dependent shape."""


def host_sync_reason(func, args, kwargs) -> str | None:
    """Why ``func(*args, **kwargs)`` would make a CUDA stream wait for the host, or None."""
    if func in HOST_SYNC_OPS:
        if func.overloadpacket is aten.repeat_interleave and kwargs.get("output_size"):
            return None
        return f"{func} reads the device on the host"
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return f"{func} with a boolean mask has a data-dependent size"
    return None


class _HostCopyCalls(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_COPY_METHODS:
            raise HostSyncError(f"{func.__name__}() copies a device tensor to the host")
        return func(*args, **(kwargs or {}))


class _HostSyncOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = host_sync_reason(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(reason)
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync():
    """Fails on every host sync inside the block (see the module docstring)."""
    with _HostCopyCalls(), _HostSyncOps():
        yield


class _AtenCall:
    def __init__(self, func, args, kwargs, result) -> None:
        self.func, self.args, self.kwargs, self.result = func, args, kwargs, result

    def replay(self) -> None:
        fresh, _ = tree_flatten(self.func(*self.args, **self.kwargs))
        kept, _ = tree_flatten(self.result)
        for new, old in zip(fresh, kept):
            if not isinstance(old, torch.Tensor) or new is old or _same_memory(new, old):
                continue  # in place, or a view of memory the replay already wrote
            if new.shape != old.shape:
                raise HostSyncError(f"{self.func}: shape {tuple(new.shape)} != {old.shape}")
            old.copy_(new)


class _TritonLaunch:
    def __init__(self, run, kernel, args, kwargs) -> None:
        self.run, self.kernel, self.args, self.kwargs = run, kernel, args, kwargs

    def replay(self) -> None:
        self.run(self.kernel, *self.args, **self.kwargs)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


class _Recorder(TorchDispatchMode):
    """Runs each ATen operation and keeps it; refuses host syncs."""

    def __init__(self, operations: list) -> None:
        super().__init__()
        self.operations = operations

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = host_sync_reason(func, args, kwargs)
        if reason is None and func in HOST_DATA_OPS:
            reason = f"{func}: host data copied into a capture"
        if reason is not None:
            raise HostSyncError(f"during graph capture: {reason}")
        result = func(*args, **kwargs)
        self.operations.append(_AtenCall(func, args, kwargs, result))
        return result


@contextlib.contextmanager
def _recording_triton_launches(operations: list):
    """Each interpreted kernel launch runs as one operation (the interpreter's own copies to and
    from its host buffers stay unrecorded) and is kept for replay."""
    if InterpretedFunction is None:
        yield
        return
    run = InterpretedFunction.run

    def launch(kernel, *args, **kwargs):
        with _disable_current_modes():
            result = run(kernel, *args, **kwargs)
        operations.append(_TritonLaunch(run, kernel, args, kwargs))
        return result

    InterpretedFunction.run = launch
    try:
        yield
    finally:
        InterpretedFunction.run = run


class EmulatedGraph:
    """``torch.cuda.CUDAGraph`` for CPU tensors (see the module docstring)."""

    def __init__(self) -> None:
        self.operations: list = []
        self.replays = 0

    def replay(self) -> None:
        for operation in self.operations:
            operation.replay()
        self.replays += 1

    def pool(self) -> tuple[int, int]:
        return (id(self), 0)

    def kernels(self) -> list[str]:
        """The names of the Triton kernels the graph launches, in order."""
        return [op.kernel.__name__ for op in self.operations if isinstance(op, _TritonLaunch)]


class EmulatedStream:
    def wait_stream(self, other: "EmulatedStream") -> None:
        pass


class EmulatedCuda:
    """The graph, stream and device API of ``torch.cuda`` on the CPU. ``capture_devices``: the
    device that was current at each capture (None: none was made current)."""

    CUDAGraph = EmulatedGraph
    Stream = EmulatedStream

    def __init__(self) -> None:
        self.capture_devices: list[torch.device | None] = []
        self._current: list[torch.device] = []
        self._stream = EmulatedStream()

    def current_stream(self) -> EmulatedStream:
        return self._stream

    @contextlib.contextmanager
    def stream(self, stream: EmulatedStream):
        yield

    @contextlib.contextmanager
    def device(self, device: torch.device):
        self._current.append(torch.device(device))
        try:
            yield
        finally:
            self._current.pop()

    @contextlib.contextmanager
    def graph(self, graph: EmulatedGraph, pool=None):
        self.capture_devices.append(self._current[-1] if self._current else None)
        graph.operations.clear()
        with (
            _HostCopyCalls(),
            _Recorder(graph.operations),
            _recording_triton_launches(graph.operations),
        ):
            yield
