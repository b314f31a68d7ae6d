"""The talker's decode attention kernels compiled by Triton 3.6 (the GPU machine's version) for
sm_90a on a machine without a GPU: their PTX, TTGIR and cubin at B = 1's configuration, which a
CUDA twin (scripts/attn_split_twin.cu) is written from. Triton's own ptxas does it; the local
Triton (3.8) would give other code, so 3.6 goes into a side folder first:

  python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
  PYTHONPATH=/tmp/t36/lib/python3.11/site-packages .venv/bin/python scripts/triton_ptx_offline.py OUTDIR

(the script prints the Triton version it ran with: it must say 3.6.0)."""
import os
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tts_server.engines.batched import tk_attention as ta, tk_glue  # noqa: E402

print("triton", triton.__version__)
target = GPUTarget("cuda", 90, 32)
out = sys.argv[1]
os.makedirs(out, exist_ok=True)


def build(fn, sig, consts, div16, name, num_warps):
    for k in consts:
        sig[k] = "constexpr"
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=3))
    for ext in ("ptx", "ttgir", "ttir"):
        open(f"{out}/{name}.{ext}", "w").write(k.asm[ext])
    open(f"{out}/{name}.cubin", "wb").write(k.asm["cubin"])
    print(name, "shared", k.metadata.shared, "warps", k.metadata.num_warps)


# B = 1 in a frame graph: PDL on, one split a program, 1 stage; bf16 pools of 16-position pages,
# 64-position splits (4 pages), 2 query heads a kv head padded to 16 rows, 2 bf16 terms, 4 warps
sig = {"q_ptr": "*fp32", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "len_ptr": "*i32", "m_ptr": "*fp32",
       "l_ptr": "*fp32", "acc_ptr": "*fp32", "scale": "fp32", "MAX_BLOCKS": "i32", "NSPLIT": "i32"}
consts = dict(NKV=8, G=2, BLOCK=16, PPS=4, HD=128, SPP=1, QR=16, TERMS=2, STAGES=1, INTERPRET=False, GDC=True,
              KV_MAJOR=False)
build(ta._attn_split_tc_kernel, dict(sig), consts,
      ["q_ptr", "k_ptr", "v_ptr", "bt_ptr", "len_ptr", "m_ptr", "l_ptr", "acc_ptr", "MAX_BLOCKS", "NSPLIT"],
      "attn_split_tc_b1", 4)
sig = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "len_ptr": "*i32", "out_ptr": "*fp16", "NH": "i32",
       "NSPLIT": "i32"}
build(ta._attn_combine_kernel, sig, dict(SPLIT_LEN=64, HD=128, HD_P2=128, GDC=True),
      ["m_ptr", "l_ptr", "acc_ptr", "len_ptr", "out_ptr", "NH", "NSPLIT"], "attn_combine_b1", 1)
# q / k norm + RoPE + the K/V store (tk_glue.qk_rope_store, the default 4 warps): bf16 pools
sig = {"qkv_ptr": "*fp32", "qn_ptr": "*fp32", "kn_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
       "cos_stride": "i32", "q_out_ptr": "*fp32", "k_pool_ptr": "*bf16", "v_pool_ptr": "*bf16", "blk_ptr": "*i64",
       "off_ptr": "*i64", "eps": "fp32"}
build(tk_glue._qk_rope_store_kernel, sig, dict(NH=16, NKV=8, BS=16, HALF=64, GDC=True),
      ["qkv_ptr", "qn_ptr", "kn_ptr", "cos_ptr", "sin_ptr", "q_out_ptr", "k_pool_ptr", "v_pool_ptr", "blk_ptr",
       "off_ptr"], "qk_rope_store_b1", 4)
