"""K2: O proj -> (Gemma post-attn norm) -> residual -> pre-MLP norm -> gate/up -> act -> down ->
(Gemma post-MLP norm) -> residual (one persistent launch; stages from ``kernels/plan.py``).

Rounding follows the reference (``k2_reference``): every projection output, norm, activation,
product and residual add is rounded to bf16 where Hugging Face rounds it; accumulation is fp32.
"""

import triton
import triton.language as tl

from monodecode.kernels.triton.gemv import gemv_task, rms_apply
from monodecode.kernels.triton.mailbox import finish_launch, launch_tag, pack, unpack, wait_words


@triton.jit
def _activation(g, GELU: tl.constexpr):
    """act(g) for fp32 g: GELU-tanh (tanh through exp) or SiLU."""
    if GELU:
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        th = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
        return 0.5 * g * (1.0 + th)
    else:
        return g / (1.0 + tl.exp(-g))


@triton.jit
def _check_finite(val, mask, health_ptr, code):
    bad = tl.sum(tl.ravel((mask & ((val != val) | (tl.abs(val) == float("inf")))).to(tl.int32)), axis=0)
    if bad > 0:
        tl.atomic_cas(health_ptr, 0, code)


@triton.jit
def _row_ss(src_mb, r, HIDDEN: tl.constexpr, BH: tl.constexpr):
    """Sum of squares over a row of (ready) mailbox words, each rounded to bf16 first."""
    ss = tl.zeros([], dtype=tl.float32)
    for c in range(0, tl.cdiv(HIDDEN, BH)):
        k = c * BH + tl.arange(0, BH)
        km = k < HIDDEN
        val = unpack(tl.load(src_mb + r * HIDDEN + k, mask=km, other=0, volatile=True)).to(tl.bfloat16).to(tl.float32)
        ss += tl.sum(val * val, axis=0)
    return ss


@triton.jit
def _post_h(o_mb, x_ptr, post_w_ptr, r, k, km, rstd_o, POST_NORMS: tl.constexpr, ONE_PLUS: tl.constexpr,
            HIDDEN: tl.constexpr):
    """Chunk of h = bf16(x + o'), o' = bf16(o) or Gemma's bf16(norm(o) * (1 + w))."""
    o = unpack(tl.load(o_mb + r * HIDDEN + k, mask=km, other=0, volatile=True)).to(tl.bfloat16).to(tl.float32)
    if POST_NORMS:
        o = rms_apply(o, rstd_o, tl.load(post_w_ptr + k, mask=km, other=0.0).to(tl.float32), ONE_PLUS).to(tl.float32)
    xr = tl.load(x_ptr + r * HIDDEN + k, mask=km, other=0.0).to(tl.float32)
    return (xr + o).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _post_task(r, x_ptr, o_mb, h_mb, hn_mb, post_w_ptr, mlp_w_ptr, eps, tag, budget, health_ptr, code,
               HIDDEN: tl.constexpr, BH: tl.constexpr, POST_NORMS: tl.constexpr, ONE_PLUS: tl.constexpr,
               POLL: tl.constexpr, UNROLL: tl.constexpr):
    """Row r: h = x + (norm)(o); hn = norm(h); both published."""
    budget = wait_words(o_mb + r * HIDDEN, HIDDEN, o_mb, 0, o_mb, 0, tag, budget, health_ptr, code, POLL, UNROLL)
    rstd_o = tl.zeros([], dtype=tl.float32)
    if POST_NORMS:
        rstd_o = 1.0 / tl.sqrt_rn(_row_ss(o_mb, r, HIDDEN, BH) / HIDDEN + eps)
    ss_h = tl.zeros([], dtype=tl.float32)
    for c in range(0, tl.cdiv(HIDDEN, BH)):
        k = c * BH + tl.arange(0, BH)
        km = k < HIDDEN
        h = _post_h(o_mb, x_ptr, post_w_ptr, r, k, km, rstd_o, POST_NORMS, ONE_PLUS, HIDDEN)
        ss_h += tl.sum(tl.where(km, h * h, 0.0), axis=0)
        tl.store(h_mb + r * HIDDEN + k, pack(h, tag), mask=km)
    rstd_h = 1.0 / tl.sqrt_rn(ss_h / HIDDEN + eps)
    for c in range(0, tl.cdiv(HIDDEN, BH)):
        k = c * BH + tl.arange(0, BH)
        km = k < HIDDEN
        h = _post_h(o_mb, x_ptr, post_w_ptr, r, k, km, rstd_o, POST_NORMS, ONE_PLUS, HIDDEN)
        hn = rms_apply(h, rstd_h, tl.load(mlp_w_ptr + k, mask=km, other=0.0).to(tl.float32), ONE_PLUS)
        tl.store(hn_mb + r * HIDDEN + k, pack(hn.to(tl.float32), tag), mask=km)
    return budget


@triton.jit
def _final_task(r, d_mb, h_mb, w_ptr, out_ptr, eps, nan_fault, tag, budget, health_ptr, code, nf_code,
                HIDDEN: tl.constexpr, BH: tl.constexpr, ONE_PLUS: tl.constexpr,
                POLL: tl.constexpr, UNROLL: tl.constexpr):
    """Row r (Gemma): out = h + norm(d)."""
    budget = wait_words(d_mb + r * HIDDEN, HIDDEN, h_mb + r * HIDDEN, HIDDEN, d_mb, 0, tag, budget, health_ptr,
                        code, POLL, UNROLL)
    rstd = 1.0 / tl.sqrt_rn(_row_ss(d_mb, r, HIDDEN, BH) / HIDDEN + eps)
    for c in range(0, tl.cdiv(HIDDEN, BH)):
        k = c * BH + tl.arange(0, BH)
        km = k < HIDDEN
        dv = unpack(tl.load(d_mb + r * HIDDEN + k, mask=km, other=0, volatile=True)).to(tl.bfloat16).to(tl.float32)
        hv = unpack(tl.load(h_mb + r * HIDDEN + k, mask=km, other=0, volatile=True))
        dn = rms_apply(dv, rstd, tl.load(w_ptr + k, mask=km, other=0.0).to(tl.float32), ONE_PLUS)
        out = (hv + dn.to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        out = tl.where((nan_fault != 0) & (r == 0) & (k == 0), float("nan"), out)
        _check_finite(out, km, health_ptr, nf_code)
        tl.store(out_ptr + r * HIDDEN + k, out.to(tl.bfloat16), mask=km)
    return budget


@triton.jit
def k2_kernel(
    x_ptr, attn_ptr, wo_ptr, so_ptr, post_w_ptr, mlp_w_ptr, wg_ptr, sg_ptr, wu_ptr, su_ptr,
    wd_ptr, sd_ptr, mlp_post_w_ptr, out_ptr, mbox_ptr, health_ptr,
    layer, spin_limit, nan_fault, eps,
    HIDDEN: tl.constexpr, Q: tl.constexpr, I: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    O_BN: tl.constexpr, O_BK: tl.constexpr, GU_BN: tl.constexpr, GU_BK: tl.constexpr,
    D_BN: tl.constexpr, D_BK: tl.constexpr, NUM_STAGES: tl.constexpr,
    O_TASKS: tl.constexpr, O_OFF: tl.constexpr, POST_OFF: tl.constexpr, GU_TASKS: tl.constexpr,
    GU_OFF: tl.constexpr, D_TASKS: tl.constexpr, D_OFF: tl.constexpr, FIN_OFF: tl.constexpr,
    EPOCH_W: tl.constexpr, O_W: tl.constexpr, H_W: tl.constexpr, HN_W: tl.constexpr,
    ACT_W: tl.constexpr, D_W: tl.constexpr, BH: tl.constexpr, POLL: tl.constexpr, UNROLL: tl.constexpr,
    NPROG: tl.constexpr, VP: tl.constexpr, POST_NORMS: tl.constexpr, ONE_PLUS: tl.constexpr,
    FP8: tl.constexpr, GELU: tl.constexpr,
):
    epoch_ptr = mbox_ptr + EPOCH_W
    tag = launch_tag(epoch_ptr, NPROG)
    budget = tl.zeros([], dtype=tl.int64) + spin_limit
    code = 1 + (2 << 8) + (layer + 1) * 1024  # wait_timeout in k2 of this layer
    nf_code = 2 + (2 << 8) + (layer + 1) * 1024  # nonfinite in k2 of this layer
    o_mb = mbox_ptr + O_W
    h_mb = mbox_ptr + H_W
    hn_mb = mbox_ptr + HN_W
    act_mb = mbox_ptr + ACT_W
    d_mb = mbox_ptr + D_W
    rows = tl.arange(0, WP)
    rmask = rows < W
    zero = tl.zeros([WP], dtype=tl.float32)

    # o_proj (input: K1's bf16 output)
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        for t in range((pid - O_OFF + NPROG) % NPROG, O_TASKS, NPROG):
            n0 = t * O_BN
            y, _y = gemv_task(
                wo_ptr, so_ptr, wo_ptr, so_ptr, n0, HIDDEN, attn_ptr, Q, post_w_ptr, zero,
                Q, W, WP, O_BN, O_BK, 1, False, FP8, ONE_PLUS, NUM_STAGES,
            )
            n = n0 + tl.arange(0, O_BN)
            tl.store(o_mb + rows[None, :] * HIDDEN + n[:, None], pack(y, tag), mask=(n < HIDDEN)[:, None] & rmask[None, :])

    # post: one task per row
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        for r in range((pid - POST_OFF + NPROG) % NPROG, W, NPROG):
            budget = _post_task(r, x_ptr, o_mb, h_mb, hn_mb, post_w_ptr, mlp_w_ptr, eps, tag, budget,
                                health_ptr, code, HIDDEN, BH, POST_NORMS, ONE_PLUS, POLL, UNROLL)

    # gate/up + activation
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        first = (pid - GU_OFF + NPROG) % NPROG
        if first < GU_TASKS:  # the whole input, once per program and stage
            budget = wait_words(hn_mb, W * HIDDEN, hn_mb, 0, hn_mb, 0, tag, budget, health_ptr, code, POLL, UNROLL)
        for t in range(first, GU_TASKS, NPROG):
            n0 = t * GU_BN
            g, u = gemv_task(
                wg_ptr, sg_ptr, wu_ptr, su_ptr, n0, I, hn_mb, HIDDEN, post_w_ptr, zero,
                HIDDEN, W, WP, GU_BN, GU_BK, 2, True, FP8, ONE_PLUS, NUM_STAGES,
            )
            gb = g.to(tl.bfloat16).to(tl.float32)
            ub = u.to(tl.bfloat16).to(tl.float32)
            a = _activation(gb, GELU).to(tl.bfloat16).to(tl.float32)
            m = (a * ub).to(tl.bfloat16).to(tl.float32)
            n = n0 + tl.arange(0, GU_BN)
            tl.store(act_mb + rows[None, :] * I + n[:, None], pack(m, tag), mask=(n < I)[:, None] & rmask[None, :])

    # down (+ residual, unless a final norm stage follows)
    for v in tl.static_range(VP):
        pid = tl.program_id(0) * VP + v
        first = (pid - D_OFF + NPROG) % NPROG
        if first < D_TASKS:  # the activations (and, without a final stage, the residual h)
            budget = wait_words(act_mb, W * I, h_mb, 0 if POST_NORMS else W * HIDDEN, h_mb, 0, tag, budget,
                                health_ptr, code, POLL, UNROLL)
        for t in range(first, D_TASKS, NPROG):
            n0 = t * D_BN
            y, _y = gemv_task(
                wd_ptr, sd_ptr, wd_ptr, sd_ptr, n0, HIDDEN, act_mb, I, post_w_ptr, zero,
                I, W, WP, D_BN, D_BK, 2, False, FP8, ONE_PLUS, NUM_STAGES,
            )
            n = n0 + tl.arange(0, D_BN)
            om = (n < HIDDEN)[:, None] & rmask[None, :]
            if POST_NORMS:
                tl.store(d_mb + rows[None, :] * HIDDEN + n[:, None], pack(y, tag), mask=om)
            else:
                hv = unpack(tl.load(h_mb + rows[None, :] * HIDDEN + n[:, None], mask=om, other=0, volatile=True))
                out = (hv + y.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
                out = tl.where((nan_fault != 0) & (rows[None, :] == 0) & (n[:, None] == 0), float("nan"), out)
                _check_finite(out, om, health_ptr, nf_code)
                tl.store(out_ptr + rows[None, :] * HIDDEN + n[:, None], out.to(tl.bfloat16), mask=om)

    if POST_NORMS:
        for v in tl.static_range(VP):
            pid = tl.program_id(0) * VP + v
            for r in range((pid - FIN_OFF + NPROG) % NPROG, W, NPROG):
                budget = _final_task(r, d_mb, h_mb, mlp_post_w_ptr, out_ptr, eps, nan_fault, tag, budget,
                                     health_ptr, code, nf_code, HIDDEN, BH, ONE_PLUS, POLL, UNROLL)

    finish_launch(epoch_ptr, VP)
