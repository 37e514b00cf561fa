"""Published peak rates of the accelerators the benchmarks report against (MFU, bandwidth share).

Dense bf16 matrix TFLOP/s (no sparsity) and HBM GB/s from the vendors' data sheets.  Matched on
``jax.Device.device_kind``; an unknown device has no peak, and the benchmarks then report only the
achieved rates.
"""

from __future__ import annotations

import jax

# (device_kind substring, bf16 dense TFLOP/s, HBM GB/s), most specific first.
PEAKS: tuple[tuple[str, float, float], ...] = (
  ("H100 PCIe", 756.0, 2000.0),
  ("H100", 989.4, 3350.0),  # SXM
  ("H200", 989.4, 4800.0),
  ("A100", 312.0, 2039.0),  # 80 GB SXM
)


def peak(device: jax.Device | None = None) -> dict | None:
  """``{"device_kind", "bf16_tflops", "hbm_gbps"}`` for a known accelerator, else None."""
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", "")
  for name, tflops, gbps in PEAKS:
    if name in kind:
      return {"device_kind": kind, "bf16_tflops": tflops, "hbm_gbps": gbps}
  return None
