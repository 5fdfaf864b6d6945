"""What the device has (versions, attention libraries, SDPA backends) and its two ceilings.

Measured ceilings (device-to-device copy bandwidth, bf16 matmul rate on random data) are printed so
the floors in stepcost.py can be compared with what this card really does."""

import importlib
import json
import sys
from collections.abc import Callable
from functools import partial

import torch

info: dict[str, object] = {"python": sys.version.split()[0], "torch": torch.__version__,
                           "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
                           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
for mod in ("triton", "flashinfer", "flash_attn", "flash_attn_interface", "sgl_kernel", "vllm"):
    try:
        m = importlib.import_module(mod)
        info[mod] = getattr(m, "__version__", "present")
    except Exception as e:
        info[mod] = f"absent ({type(e).__name__})"
b = torch.backends.cuda
info["sdpa"] = {"flash": b.flash_sdp_enabled(), "mem_efficient": b.mem_efficient_sdp_enabled(),
                "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled()}


def med(fn: Callable[[], object], reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1))
    return float(sorted(ts)[reps // 2])


src = torch.randn(2 * 2**30 // 2, device="cuda", dtype=torch.bfloat16)
dst = torch.empty_like(src)
t = med(partial(dst.copy_, src))
info["copy_TBps"] = round(2 * src.numel() * 2 / (t / 1e3) / 1e12, 3)
del src, dst
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
bm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
t = med(partial(torch.matmul, a, bm))
info["bf16_matmul_TFLOPs"] = round(2 * 8192**3 / (t / 1e3) / 1e12, 1)
print("PROBE " + json.dumps(info))
