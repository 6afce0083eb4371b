"""Dense peak FLOP/s of data-centre GPUs, the denominator of MFU.

Lightning's table (`get_available_flops`) misses the H200 as torch names it ("NVIDIA H200") and gives sparse figures
for the H100 NVL and the H200; MFU against a sparse peak is half what it should be. NVIDIA's datasheets print the
tensor-core figures "with sparsity": the dense figures below are those halved (TFLOP/s; "tf32" is an fp32 matmul on
tensor cores, `torch.set_float32_matmul_precision("high")`). A chip not listed here falls back to Lightning's table;
`--peak_tflops` overrides both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Peak:
    """Dense TFLOP/s of one GPU model."""

    pattern: str
    """Regular expression matched against torch.cuda.get_device_name(), lowercased."""
    bf16: Optional[float]
    fp16: float
    tf32: Optional[float]
    fp32: float
    source: str


PEAKS = (
    Peak(r"h200 nvl", 835.5, 835.5, 417.5, 60.0,
         "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446 (H200 NVL)"),
    Peak(r"h200", 989.4, 989.4, 494.7, 67.0,
         "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446 (H200 SXM)"),
    Peak(r"h100 nvl", 835.5, 835.5, 417.5, 60.0, "https://resources.nvidia.com/en-us-tensor-core (H100 NVL)"),
    Peak(r"h100.*pcie", 756.0, 756.0, 378.0, 51.2, "https://resources.nvidia.com/en-us-tensor-core (H100 PCIe)"),
    Peak(r"h100", 989.4, 989.4, 494.7, 66.9, "https://resources.nvidia.com/en-us-tensor-core (H100 SXM)"),
    Peak(r"a100", 312.0, 312.0, 156.0, 19.5,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    Peak(r"l40s", 362.05, 362.05, 183.0, 91.6, "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    Peak(r"\bl4\b", 121.0, 121.0, 60.0, 30.3, "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"),
    Peak(r"\ba10\b", 125.0, 125.0, 62.5, 31.2,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"),
    Peak(r"v100.*pcie", None, 112.0, None, 14.0,
         "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    Peak(r"v100", None, 125.0, None, 15.7,
         "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    Peak(r"\bt4\b", None, 65.0, None, 8.1,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"),
    Peak(r"rtx 4090", 165.2, 165.2, 82.6, 82.6,
         "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (FP32 accumulate)"),
)


def listed_peak(device_name: str) -> Optional[Peak]:
    """The first entry whose pattern matches the device name (more specific names come first)."""
    name = device_name.lower()
    return next((peak for peak in PEAKS if re.search(peak.pattern, name)), None)


def peak_tflops(device_name: str, dtype: torch.dtype, matmul_precision: str) -> Optional[float]:
    """Dense TFLOP/s of a listed GPU for matmuls in `dtype`; None when it is not listed or lacks the dtype."""
    peak = listed_peak(device_name)
    if peak is None:
        return None
    if dtype == torch.bfloat16:
        return peak.bf16
    if dtype == torch.float16:
        return peak.fp16
    return peak.tf32 if matmul_precision != "highest" and peak.tf32 is not None else peak.fp32
