"""Zero-gradient AdamW steps, k of them folded in registers: the Triton kernel for CUDA
parameters and its pure-torch emulation of torch's CUDA rounding (the test oracle on CPU).

What torch runs on CUDA. ``torch.optim.AdamW`` with ``foreach=None`` (the default) takes
``_multi_tensor_adam`` with decoupled weight decay for CUDA parameters. With grad = 0 and
capturable=False, one step is these foreach ops, each one CUDA kernel (ATen's
``ForeachFunctors.cuh``) that loads T (the parameter dtype), computes in opmath_t = float and
rounds once to T when it stores; every scalar is a Python double converted to float:
    p = p * decay                   _foreach_mul_ (skipped when weight_decay == 0: decay = 1 is
                                    the identity, so the kernel multiplies by 1)
    m = lerp(m, 0, w)               _foreach_lerp_, Lerp.h with w = 1 - beta1: for |w| < 0.5
                                    ``self + w * (end - self)``, which nvcc contracts to
                                    fma(w, 0 - m, m); otherwise ``end - (end - self) * (1 - w)``,
                                    contracted to fma(-(0 - m), 1 - w, 0)
    v = v * beta2                   _foreach_mul_
    v = v + (1 - beta2) * (0 * 0)   _foreach_addcmul_: adds +0, which leaves v unchanged (v is
                                    never -0: it starts at +0 and only grows by g*g >= +0)
    d = sqrt(v)                     _foreach_sqrt, a new tensor of dtype T; IEEE sqrt.rn
    d = d / denom_scale             _foreach_div_ by sqrt(1 - beta2^t), IEEE div.rn (std::divides,
                                    no reciprocal)
    d = d + eps                     _foreach_add_
    p = p + neg_step * (m / d)      _foreach_addcdiv_ with neg_step = -lr / (1 - beta1^t):
                                    ``a + s * op(b, c)``, contracted to fma(neg_step, m / d, p)
The step counter is a CPU float32 tensor (``state["step"] += 1`` per step); the bias corrections
are Python doubles from it.

The Triton kernel computes exactly these, with the k steps in a loop over registers: one read and
one write of (p, m, v) per call instead of k. ``tl.fma`` where nvcc fuses, ``tl.div_rn`` and
``tl.sqrt_rn`` for the IEEE division and square root, every intermediate that torch stores in T
rounded to T (bf16: round to nearest even, done on the bits so the interpreter rounds as the GPU
does), and the launch passes ``enable_fp_fusion=False`` so that nothing else is fused. One launch
covers every tensor of one device and dtype: each program finds its tensor by a binary search over the
tensors' first block indices, and loads the tensor's addresses from a table.

What cannot be checked without a GPU: that nvcc contracted exactly the multiply-adds named above
in the torch binary (the source leaves it to -fmad=true, the default). Without a GPU the tests
compile the kernel for sm_90 and count its PTX roundings (fma.rn, mul.rn, div.rn, sqrt.rn,
add.rn per element-step); that the machine code runs them is left to ptxas. The same file
compares the kernel with torch's
own CUDA AdamW bit for bit when CUDA is present. On CPU, under TRITON_INTERPRET=1, ``tl.fma`` is
``x * y + z`` in numpy float32 (two roundings); the tests give the interpreter a correctly
rounded fma (``fma_float32``) and then compare the kernel with ``zero_grad_adamw_reference_``.

``zero_grad_adamw_reference_`` emulates the sequence above op by op with provably correct
float32 rounding on any device: a float32 sum, product, quotient or square root is computed in
float64 and rounded to float32; that double rounding is innocuous for these four operations
because 53 >= 2 * 24 + 2 (Figueroa, "When is double rounding innocuous?", 1995). It is not for
fma, hence ``fma_float32``; and torch's float64 sqrt on CPU is not always correctly rounded,
hence ``sqrt_float32``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the emulation needs no Triton
    triton = None

# Columns of the per-tensor scalar table (float32, one row per tensor): three per-tensor
# constants, then (decay, denom_scale, neg_step) for each folded step.
LERP_WEIGHT, BETA2, EPS, FIRST_STEP_COLUMN, COLUMNS_PER_STEP = 0, 1, 2, 3, 3
BLOCK = 2048


def scalar_table(
    constants: list[tuple[float, float, float]], steps: list[list[tuple[float, float, float]]]
) -> torch.Tensor:
    """float32 [tensors, 3 + 3k] from Python doubles: per tensor (1 - beta1, beta2, eps) and, per
    folded step, (1 - lr*wd, sqrt(1 - beta2^t), -lr / (1 - beta1^t)). Each double is rounded to
    the nearest float, as CUDA's foreach ops do with a Scalar."""
    rows = [list(c) + [x for step in s for x in step] for c, s in zip(constants, steps)]
    return torch.tensor(rows, dtype=torch.float64).to(torch.float32)


# ---- emulation of torch's CUDA foreach rounding, in pure torch --------------------------------


def fma_float32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32 (what CUDA's fma.rn computes), for float32 inputs.

    a * b is exact in float64 (24 + 24 significant bits). The float64 sum s = RN(ab + c) is not,
    and rounding it again to float32 can be wrong when s lands on a float32 tie. So the exact
    error of the sum is recovered (TwoSum: ab + c = s + e exactly), s is turned into the
    round-to-odd float64 sum (an inexact s moves to its odd neighbour toward e), and that rounds
    correctly to float32 because 53 >= 24 + 2 (Boldo and Melquiond, "Emulation of FMA and
    correctly rounded sums: proved algorithms using rounding to odd", 2008).
    """
    product, addend = a.double() * b.double(), c.double()
    total = product + addend
    addend_part = total - product
    error = (product - (total - addend_part)) + (addend - addend_part)
    even = (total.view(torch.int64) & 1) == 0
    toward_error = torch.where(error > 0, torch.inf, -torch.inf).to(torch.float64)
    return torch.where((error != 0) & even, torch.nextafter(total, toward_error), total).to(
        torch.float32
    )


def sqrt_float32(x: torch.Tensor) -> torch.Tensor:
    """IEEE float32 square root of x >= 0 (float32). torch's float64 sqrt may be an ulp off, so
    its float32 rounding is corrected against the squares of the midpoints to the neighbours,
    which are exact in float64 (25-bit midpoints, 50-bit squares); a square root is never a tie."""
    exact = x.double()
    root = torch.sqrt(exact).to(torch.float32)
    up = torch.nextafter(root, torch.full_like(root, torch.inf))
    down = torch.nextafter(root, torch.zeros_like(root))
    mid_up = (root.double() + up.double()) / 2
    mid_down = (root.double() + down.double()) / 2
    root = torch.where(exact > mid_up * mid_up, up, root)
    return torch.where((root > 0) & (exact < mid_down * mid_down), down, root)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> nearest bfloat16 (ties to even) -> float32, as torch stores a bf16 result."""
    return x.to(torch.bfloat16).to(torch.float32)


def zero_grad_adamw_reference_(
    params: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    scalars: torch.Tensor,
) -> None:
    """The op sequence of the module docstring, in place, one tensor at a time, with float32
    rounding emulated exactly (float32 or bfloat16 tensors, any device). ``scalars`` is
    ``scalar_table``'s [tensors, 3 + 3k] float32 table."""
    for row, param, exp_avg, exp_avg_sq in zip(scalars, params, exp_avgs, exp_avg_sqs):
        row = row.to(param.device)
        stored = round_to_bf16 if param.dtype == torch.bfloat16 else (lambda x: x)
        weight, beta2, eps = row[LERP_WEIGHT], row[BETA2], row[EPS]
        one_minus_weight = _float32(1.0 - weight.double())
        p, m, v = param.float(), exp_avg.float(), exp_avg_sq.float()
        for decay, denom_scale, neg_step in row[FIRST_STEP_COLUMN:].view(-1, COLUMNS_PER_STEP):
            p = stored(_float32(p.double() * decay.double()))
            towards_zero = torch.zeros_like(m) - m  # end - self with end = +0
            if weight.abs() < 0.5:
                m = stored(fma_float32(weight.expand_as(m), towards_zero, m))
            else:
                m = stored(
                    fma_float32(-towards_zero, one_minus_weight.expand_as(m), torch.zeros_like(m))
                )
            v = stored(_float32(v.double() * beta2.double()))
            d = stored(sqrt_float32(v))
            d = stored(_float32(d.double() / denom_scale.double()))
            d = stored(_float32(d.double() + eps.double()))
            quotient = _float32(m.double() / d.double())
            p = stored(fma_float32(neg_step.expand_as(p), quotient, p))
        param.copy_(p)
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


def _float32(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, round to nearest even."""
    return x.to(torch.float32)


# ---- the Triton kernel ------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _load_fp32(ptrs, mask, IS_BF16: tl.constexpr):
        if IS_BF16:
            b_bits = tl.load(ptrs, mask=mask, other=0).to(tl.uint32) << 16
            return b_bits.to(tl.float32, bitcast=True)
        else:
            return tl.load(ptrs, mask=mask, other=0.0)

    @triton.jit
    def _stored(x, IS_BF16: tl.constexpr):
        """x as torch stores it in the parameter dtype: bf16 rounds to nearest even (c10's
        round_to_nearest_even and cvt.rn.bf16.f32 agree for finite x), fp32 is unchanged."""
        if IS_BF16:
            b_bits = x.to(tl.uint32, bitcast=True)
            b_bits = ((b_bits + 0x7FFF + ((b_bits >> 16) & 1)) >> 16) << 16
            return b_bits.to(tl.float32, bitcast=True)
        else:
            return x

    @triton.jit
    def _store_fp32(ptrs, x, mask, IS_BF16: tl.constexpr):
        if IS_BF16:
            tl.store(ptrs, (x.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16), mask=mask)
        else:
            tl.store(ptrs, x, mask=mask)

    @triton.jit
    def _zero_grad_adamw_kernel(
        p_addresses,
        p_first_blocks,
        p_scalars,
        n_tensors,
        stride_scalars,
        SEARCH_STEPS: tl.constexpr,
        STEPS: tl.constexpr,
        BLOCK: tl.constexpr,
        ELEMENT: tl.constexpr,
        IS_BF16: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        # p_addresses: int64 [4, n_tensors] rows param, exp_avg, exp_avg_sq addresses, numel.
        # p_first_blocks: int64 [n_tensors + 1], the first block of each tensor, then the total.
        # ELEMENT: what memory holds, float32, or bf16 as its uint16 bits.
        # ALIGNED: the host checked that every address is 16-byte aligned and every numel a
        # multiple of 8, so loads and stores may be 16 bytes wide (as torch's foreach kernels do
        # on their aligned path); the arithmetic is the same either way.
        i_block = tl.program_id(0).to(tl.int64)
        # Largest tensor index whose first block <= i_block (first_blocks is increasing).
        i_lo = tl.zeros([], dtype=tl.int64)
        i_hi = tl.zeros([], dtype=tl.int64) + n_tensors
        for _ in range(SEARCH_STEPS):
            i_mid = (i_lo + i_hi) // 2
            go_right = tl.load(p_first_blocks + i_mid) <= i_block
            i_lo = tl.where(go_right, i_mid, i_lo)
            i_hi = tl.where(go_right, i_hi, i_mid)
        i_tensor = i_lo
        numel = tl.load(p_addresses + 3 * n_tensors + i_tensor)
        o_elem = (i_block - tl.load(p_first_blocks + i_tensor)) * BLOCK + tl.arange(0, BLOCK)
        m_elem = o_elem < numel
        p_param = tl.load(p_addresses + i_tensor).to(tl.pointer_type(ELEMENT))
        p_exp_avg = tl.load(p_addresses + n_tensors + i_tensor).to(tl.pointer_type(ELEMENT))
        p_exp_avg_sq = tl.load(p_addresses + 2 * n_tensors + i_tensor).to(tl.pointer_type(ELEMENT))
        if ALIGNED:
            numel = tl.multiple_of(numel, 8)
            p_param = tl.multiple_of(p_param, 16)
            p_exp_avg = tl.multiple_of(p_exp_avg, 16)
            p_exp_avg_sq = tl.multiple_of(p_exp_avg_sq, 16)
        p_param += o_elem
        p_exp_avg += o_elem
        p_exp_avg_sq += o_elem
        b_p = _load_fp32(p_param, m_elem, IS_BF16)  # [BLOCK] fp32
        b_m = _load_fp32(p_exp_avg, m_elem, IS_BF16)
        b_v = _load_fp32(p_exp_avg_sq, m_elem, IS_BF16)

        p_row = p_scalars + i_tensor * stride_scalars
        lerp_weight = tl.load(p_row)
        beta2 = tl.load(p_row + 1)
        eps = tl.load(p_row + 2)
        weight_is_small = tl.abs(lerp_weight) < 0.5
        one_minus_weight = 1.0 - lerp_weight
        for i_step in range(STEPS):
            p_step = p_row + 3 + 3 * i_step
            decay = tl.load(p_step)
            denom_scale = tl.load(p_step + 1)
            neg_step = tl.load(p_step + 2)
            b_p = _stored(b_p * decay, IS_BF16)
            b_towards_zero = 0.0 - b_m
            b_m = _stored(
                tl.where(
                    weight_is_small,
                    tl.fma(lerp_weight, b_towards_zero, b_m),
                    tl.fma(-b_towards_zero, one_minus_weight, 0.0),
                ),
                IS_BF16,
            )
            b_v = _stored(b_v * beta2, IS_BF16)
            b_d = _stored(tl.sqrt_rn(b_v), IS_BF16)
            b_d = _stored(tl.div_rn(b_d, denom_scale), IS_BF16)
            b_d = _stored(b_d + eps, IS_BF16)
            b_p = _stored(tl.fma(neg_step, tl.div_rn(b_m, b_d), b_p), IS_BF16)
        _store_fp32(p_param, b_p, m_elem, IS_BF16)
        _store_fp32(p_exp_avg, b_m, m_elem, IS_BF16)
        _store_fp32(p_exp_avg_sq, b_v, m_elem, IS_BF16)


def zero_grad_adamw_triton_(
    params: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    scalars: torch.Tensor,
) -> None:
    """``zero_grad_adamw_reference_`` in one launch over all tensors, in place. The tensors share
    one dtype (float32 or bfloat16) and one device (CUDA, or CPU under TRITON_INTERPRET=1) and are
    contiguous; ``scalars`` is ``scalar_table``'s float32 table, one row per tensor."""
    if triton is None:
        raise RuntimeError("the Triton backend needs the triton package")
    dtype, device = params[0].dtype, params[0].device
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"float32 and bfloat16 only, got {dtype}")
    tensors = [t for group in (params, exp_avgs, exp_avg_sqs) for t in group]
    if any(t.dtype != dtype or t.device != device or not t.is_contiguous() for t in tensors):
        raise ValueError("params and moments must be contiguous and share one dtype and device")
    if not all(
        p.numel() == m.numel() == v.numel() for p, m, v in zip(params, exp_avgs, exp_avg_sqs)
    ):
        raise ValueError("each param and its moments must have the same size")
    live = [i for i, p in enumerate(params) if p.numel() > 0]
    if not live:
        return
    blocks = [triton.cdiv(params[i].numel(), BLOCK) for i in live]
    first_blocks = [0]
    for count in blocks:
        first_blocks.append(first_blocks[-1] + count)
    addresses = [[group[i].data_ptr() for i in live] for group in (params, exp_avgs, exp_avg_sqs)]
    addresses.append([params[i].numel() for i in live])
    addresses = torch.tensor(addresses, dtype=torch.int64).to(device)
    first_blocks_device = torch.tensor(first_blocks, dtype=torch.int64).to(device)
    live_scalars = scalars[live].to(device=device, dtype=torch.float32).contiguous()
    n_steps = (live_scalars.shape[1] - FIRST_STEP_COLUMN) // COLUMNS_PER_STEP
    is_bf16 = dtype == torch.bfloat16
    _zero_grad_adamw_kernel[(first_blocks[-1],)](
        addresses,
        first_blocks_device,
        live_scalars,
        len(live),
        live_scalars.stride(0),
        SEARCH_STEPS=(len(live) - 1).bit_length(),
        STEPS=n_steps,
        BLOCK=BLOCK,
        ELEMENT=tl.uint16 if is_bf16 else tl.float32,
        IS_BF16=is_bf16,
        ALIGNED=all(t.data_ptr() % 16 == 0 and t.numel() % 8 == 0 for t in tensors),
        num_warps=8,
        enable_fp_fusion=False,
    )
