import sys, time, json, os
import torch
sys.path.insert(0, "tests")
import importlib.util
spec = importlib.util.spec_from_file_location("tnum", "tests/test_triton_numerics.py")
T = importlib.util.module_from_spec(spec); spec.loader.exec_module(T)
import monodecode.kernels.triton.launch as Lm
from monodecode.kernels.base import decode_health
R = T.R
orig = Lm.compile_options
BUILDS = [("llama3-8b","bf16",(1,3,8),2), ("tiny","bf16",(2,),4)]
def opts_for(variant, target):
    o = dict(orig(target))
    if "ns1" in variant: o["num_stages"] = 1
    if "nocoop" in variant: o.pop("launch_cooperative_grid", None)
    return o

def _compile(job):
    variant, prof, wd, widths, width, which = job
    import triton
    from triton.backends.compiler import GPUTarget
    from monodecode.kernels.plan import plan_model
    from monodecode.kernels.triton.config import CUDA
    from monodecode.kernels.triton.offline import kernel_sources
    from monodecode.model.profiles import profile_dims
    dims = profile_dims(prof)
    src = dict(kernel_sources(dims, wd, width, 16, plan_model(dims, 1, list(widths), 132), CUDA))[which]
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts_for(variant, CUDA))
    return job

VARIANTS = sys.argv[1].split(",")
if __name__ == "__main__":
    from concurrent.futures import ProcessPoolExecutor
    jobs = [(v, p, d, ws, w, k) for v in VARIANTS for p, d, ws, _ in BUILDS for w in ws for k in ("k1", "k2")]
    t0 = time.monotonic()
    with ProcessPoolExecutor(16) as ex:
        list(ex.map(_compile, jobs))
    print("compiled", len(jobs), time.monotonic() - t0, flush=True)
dev = torch.device("cuda")
for variant in VARIANTS:
  Lm.compile_options = lambda target, v=variant: opts_for(v, target)
  T._CACHE.clear()
  for prof, wd, widths, layers in BUILDS:
    dims, weights, tk = T._build(prof, wd, widths, layers, wait_timeout_s=0.05)
    for width in widths:
        alloc, kv_ref, kv_tri = T._context(dims, layers, T._ctx_lens(width, width), dev, seed=width)
        meta = alloc.decode_metadata(list(range(width)), device=dev)
        x = torch.randn(width, dims.hidden_size, device=dev).to(torch.bfloat16)
        a_ref = R.k1_reference(dims, 0, weights.layers[0], x, meta, kv_ref)
        keys = [k.clone() for k in kv_tri.key]; vals = [v.clone() for v in kv_tri.value]
        errs = []; times = []; healths = []
        for trial in range(10):
            kv = T.PagedKVCache([k.clone() for k in keys], [v.clone() for v in vals], T.BLOCK)
            tk.reset_health(); torch.cuda.synchronize(); t0 = time.monotonic()
            a = tk.k1(0, x, meta, kv); torch.cuda.synchronize(); times.append(round((time.monotonic()-t0)*1e3, 2))
            h = tk.health(); healths.append(decode_health(h).describe() if h else "ok")
            d = (a.float() - a_ref.float()).view(width, -1, dims.head_dim)
            per_head = (d.norm(dim=-1) / a_ref.float().view(width, -1, dims.head_dim).norm(dim=-1)).nan_to_num(99)
            bad = (per_head > 0.02).nonzero().tolist()
            # stage checks: qkv words vs reference projections; host-side combine of the partials
            lp = tk.plan.layers[width]
            def words(name):
                r_ = lp.region(name); return tk.scratch[r_.word_offset:r_.word_offset + r_.words].view(r_.shape)
            def val(w_): return (w_ & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
            lw = weights.layers[0]
            xn = R.rms_norm(x, lw.attn_norm, dims.rms_norm_eps, dims.norm_one_plus)
            qkv_ref = torch.cat([lw.q_proj(xn, out_dtype=torch.float32), lw.k_proj(xn, out_dtype=torch.float32), lw.v_proj(xn, out_dtype=torch.float32)], 1)
            qkv_err = float(((val(words("qkv")) - qkv_ref).norm() / qkv_ref.norm()))
            m_ = val(words("attn_ml"))[..., 0]; l_ = val(words("attn_ml"))[..., 1]; acc_ = val(words("attn_acc"))
            big = m_.max(-1, keepdim=True).values; wts = torch.exp(m_ - big)
            host = (wts[..., None] * acc_).sum(2) / (wts * l_).sum(-1)[..., None]
            comb_err = float((host.view(width, -1).bfloat16().float() - a.float()).abs().max())
            ttag = int((words("attn_ml") >> 32).min()), int((words("attn_ml") >> 32).max()), int((words("qkv") >> 32).min()), int((words("qkv") >> 32).max())
            errs.append((round(float(per_head.max()), 4), bad[:6], round(qkv_err, 6), round(comb_err, 4), ttag))
        line = dict(variant=variant, prof=prof, width=width, times=times, health=healths, errs=errs)
        print(json.dumps(line), flush=True)
