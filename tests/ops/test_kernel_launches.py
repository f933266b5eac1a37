"""Every Triton kernel launch of the wrappers, as a GPU would take it, proven on the CPU.

Each wrapper runs under the interpreter with every launch recorded, then:
- the launch's arguments and options go through what compiled Triton does before compiling for
  sm_90 (``aot_sm90.parse_launch_for_sm90``): the interpreter drops a keyword it does not know,
  compiled Triton raises on it;
- the launch ran inside ``rlvr_fast.ops.launch.on_device`` of its tensors' device (Triton
  launches on the current device), and ``on_device`` makes a CUDA tensor's device current
  (a mocked ``torch.cuda``);
- every kernel defined in ``rlvr_fast.kernels`` (``_*_kernel``) has a case here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
import types

import pytest
import torch
from aot_sm90 import parse_launch_for_sm90

import rlvr_fast.kernels
from rlvr_fast.ops import zero_grad_adamw as zero_grad_adamw_op
from rlvr_fast.kernels.zero_grad_adamw import zero_grad_adamw_triton_
from rlvr_fast.ops import launch
from rlvr_fast.ops.paged_attention import paged_attention, paged_prefill_attention
from rlvr_fast.ops.policy_loss import PolicyLossSettings, fused_policy_loss
from rlvr_fast.ops.qk_norm_rope import qk_norm_rope_store
from rlvr_fast.ops.rms_norm import add_rms_norm, rms_norm
from rlvr_fast.ops.silu_mul import silu_mul
from rlvr_fast.ops.top_p_sampling import sample_top_p
from rlvr_fast.ops.weighted_nll import weighted_token_nll

interpreter = pytest.importorskip("triton.runtime.interpreter")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="records the interpreter's launches; a GPU compiles them"
)


def paged_decode(dtype):
    q = torch.randn(3, 4, 16, dtype=dtype)
    k = torch.randn(6, 4, 2, 16, dtype=dtype)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    paged_attention(q, k, torch.randn_like(k), tables, torch.tensor([3, 8, 5]), backend="triton")


def paged_decode_split(dtype):
    """A context of 10 blocks of 4 tokens spans two 32-token tiles: two splits, then their
    combine."""
    q = torch.randn(1, 4, 16, dtype=dtype)
    k = torch.randn(10, 4, 2, 16, dtype=dtype)
    tables = torch.arange(10, dtype=torch.int32)[None]
    paged_attention(q, k, torch.randn_like(k), tables, torch.tensor([37]), backend="triton")


def paged_prefill(dtype):
    q = torch.randn(2, 4, 3, 16, dtype=dtype)
    k = torch.randn(4, 4, 2, 16, dtype=dtype)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([[4, 5, 6], [6, 7, 8]])
    paged_prefill_attention(q, k, torch.randn_like(k), tables, lens, backend="triton")


def weighted_nll(dtype, grad: bool):
    hidden = torch.randn(5, 8, dtype=dtype, requires_grad=grad)
    weight = torch.randn(37, 8, dtype=dtype, requires_grad=grad)
    targets = torch.randint(0, 37, (5,))
    loss = weighted_token_nll(hidden, weight, targets, torch.randn(5), backend="triton")
    if grad:
        loss.backward()


def norms(dtype):
    x, weight = torch.randn(3, 40, dtype=dtype), torch.randn(40, dtype=dtype)
    rms_norm(x, weight, 1e-6, backend="triton")
    add_rms_norm(x, torch.randn_like(x), weight, 1e-6, backend="triton")


def qk_norm_rope(dtype):
    tokens, q_heads, kv_heads, head_dim = 3, 4, 2, 16
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    norm = torch.randn(head_dim, dtype=dtype)
    cos, sin = torch.randn(tokens, 1, head_dim), torch.randn(tokens, 1, head_dim)
    slots = torch.zeros(8, kv_heads, head_dim, dtype=dtype)
    qk_norm_rope_store(
        qkv, norm, norm, 1e-6, cos, sin, slots, slots.clone(), torch.tensor([0, 5, 7]), q_heads,
        backend="triton",
    )  # fmt: skip


def silu_and_mul(dtype):
    silu_mul(torch.randn(3, 2 * 40, dtype=dtype), backend="triton")


def top_p(dtype):
    """Launches recorded, not run: the draw's 4,096-slot sort takes minutes in the interpreter
    (tests/ops/test_top_p_sampling.py runs the kernels)."""
    logits = torch.randn(3, 300, dtype=dtype)
    sample_top_p(logits, torch.arange(3), torch.arange(3), 0.7, 0.9)


top_p.record_only = True


def policy_loss(dtype):
    hidden = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(37, 8, dtype=dtype, requires_grad=True)
    loss, _ = fused_policy_loss(
        hidden, weight, torch.randint(0, 37, (5,)), torch.randn(5), torch.randn(2), [2, 3],
        PolicyLossSettings(beta=0.04), ref_logprobs=torch.randn(5), backend="triton",
    )  # fmt: skip
    loss.backward()


def zero_grad_adamw(dtype):
    """The CUDA path of ``zero_grad_adamw_`` (``_fold_foreach``) on CPU parameters."""
    params = [torch.randn(n, dtype=dtype) for n in (5, 2048 + 3)]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    group = optimizer.param_groups[0]
    zero_grad_adamw_op._fold_foreach(optimizer, [(p, group, [1e-3, 1e-3]) for p in params])


CASES = {
    f"{name} {str(dtype)[6:]}": (case, dtype)
    for dtype in (torch.float32, torch.bfloat16)
    for name, case in {
        "paged decode": paged_decode,
        "paged decode, split": paged_decode_split,
        "rms norms": norms,
        "qk norm rope store": qk_norm_rope,
        "silu mul": silu_and_mul,
        "top-p sampling": top_p,
        "policy loss": policy_loss,
        "paged prefill": paged_prefill,
        "weighted nll, grad": lambda d: weighted_nll(d, True),
        "weighted nll, no grad": lambda d: weighted_nll(d, False),
        "zero-grad adamw": zero_grad_adamw,
    }.items()
}


def defined_kernels() -> set[str]:
    names = set()
    for info in pkgutil.iter_modules(rlvr_fast.kernels.__path__):
        module = importlib.import_module(f"rlvr_fast.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, interpreter.InterpretedFunction) and name.endswith("_kernel"):
                names.add(name)
    return names


def recorded_launches(monkeypatch, case) -> list[types.SimpleNamespace]:
    """Run ``case`` with each launch recorded with the devices made current by ``on_device``
    (and not run, for a case marked ``record_only``)."""
    record_only = getattr(getattr(case, "func", case), "record_only", False)
    launches, current = [], []
    run, real_on_device = interpreter.InterpretedFunction.run, launch.on_device

    def recording_run(kernel, *args, grid, warmup, **kwargs):
        launches.append(types.SimpleNamespace(kernel=kernel, args=args, kwargs=kwargs))
        launches[-1].current = list(current)
        if not record_only:
            return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    @contextlib.contextmanager
    def tracking_on_device(tensor):
        current.append(tensor.device)
        try:
            with real_on_device(tensor):
                yield
        finally:
            current.pop()

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    monkeypatch.setattr(launch, "on_device", tracking_on_device)
    case()
    assert launches, "the case launched no kernel"
    return launches


@pytest.mark.parametrize("name", CASES)
def test_launch_options_parse_for_sm90_and_launches_run_on_their_tensors_device(monkeypatch, name):
    case, dtype = CASES[name]
    for launched in recorded_launches(monkeypatch, functools.partial(case, dtype)):
        options, _ = parse_launch_for_sm90(launched.kernel, launched.args, launched.kwargs)
        for option, value in launched.kwargs.items():
            if option in options.__dict__:
                assert getattr(options, option) == value, option
        devices = {a.device for a in launched.args if isinstance(a, torch.Tensor)}
        assert launched.current and devices == {launched.current[-1]}, launched.kernel.__name__


def test_every_kernel_has_a_launch_case(monkeypatch):
    launched = {
        launched.kernel.__name__
        for case, dtype in CASES.values()
        if dtype == torch.float32  # every case launches the same kernels in both dtypes
        for launched in recorded_launches(monkeypatch, functools.partial(case, dtype))
    }
    assert defined_kernels() <= launched, "add a case for each kernel in rlvr_fast/kernels"
    assert len(defined_kernels()) >= 3


def test_an_unknown_launch_keyword_is_refused_as_compiled_triton_refuses_it(monkeypatch):
    """The interpreter ran it; the sm_90 parser raises, so the parse above can fail."""
    params = [torch.randn(8)]
    (launched,) = recorded_launches(
        monkeypatch,
        lambda: zero_grad_adamw_triton_(
            params, [torch.zeros(8)], [torch.zeros(8)], torch.ones(1, 6)
        ),
    )
    with pytest.raises(KeyError, match="num_warp"):
        parse_launch_for_sm90(launched.kernel, launched.args, {**launched.kwargs, "num_warp": 8})


def test_on_device_makes_a_cuda_tensors_device_current(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def current_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", current_device)
    with launch.on_device(types.SimpleNamespace(device=torch.device("cuda", 1))):
        assert entered == [torch.device("cuda", 1)]
    with launch.on_device(torch.zeros(1)):
        pass
    assert entered == [torch.device("cuda", 1)], "nothing to make current on the CPU"
