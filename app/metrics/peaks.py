"""Dense peak FLOP/s of NVIDIA GPUs, the denominator of MFU.

Written here rather than taken from Lightning's table (`get_available_flops`), which misses the H200 as torch names
it ("NVIDIA H200"), gives sparse figures for the H100 NVL and the H200 (MFU against a sparse peak is half what it
should be), reads the L40 as an L4, gives the A6000, the A40 and the GeForce cards their CUDA-core figures, not their
tensor cores' (MFU 2 to 4 times too high), and takes "H100 80GB HBM2e" (how the PCIe card names itself) for the SXM
one here. NVIDIA's datasheets print the tensor-core figures "with sparsity": the dense figures below are those halved
(TFLOP/s; "tf32" is an fp32 matmul on tensor cores, `torch.set_float32_matmul_precision("high")`; GeForce cards at
FP32 accumulate, as torch's matmuls run). A chip not listed here has no MFU unless `--peak_tflops` gives its figure,
which overrides the table.
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
    Peak(r"h[18]00.*(pcie|hbm2e)", 756.0, 756.0, 378.0, 51.2,
         "https://resources.nvidia.com/en-us-tensor-core (H100 PCIe; the H800 PCIe computes as it)"),
    Peak(r"h[18]00", 989.4, 989.4, 494.7, 66.9,
         "https://resources.nvidia.com/en-us-tensor-core (H100 SXM; the H800 computes as it)"),
    Peak(r"\bh20\b", 148.0, 148.0, 74.0, 44.0, "https://www.nvidia.com/en-us/data-center/h20/ (H20)"),
    Peak(r"gb200", 2500.0, 2500.0, 1250.0, 80.0, "https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (GB200)"),
    Peak(r"b200", 2250.0, 2250.0, 1100.0, 75.0, "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200)"),
    Peak(r"a[18]00", 312.0, 312.0, 156.0, 19.5,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (the A800 computes as it)"),
    Peak(r"l40s", 362.05, 362.05, 183.0, 91.6, "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    Peak(r"\bl40\b", 181.05, 181.05, 90.5, 90.5,
         "https://images.nvidia.com/content/Solutions/data-center/vgpu-L40-datasheet.pdf (L40)"),
    Peak(r"\bl4\b", 121.0, 121.0, 60.0, 30.3, "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"),
    Peak(r"\ba10\b", 125.0, 125.0, 62.5, 31.2,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"),
    Peak(r"\ba40\b", 149.7, 149.7, 74.8, 37.4,
         "https://images.nvidia.com/content/Solutions/data-center/a40/nvidia-a40-datasheet.pdf (A40)"),
    Peak(r"rtx a6000", 154.8, 154.8, 77.4, 38.7,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/design-visualization/quadro-product-literature/"
         "proviz-print-nvidia-rtx-a6000-datasheet-us-nvidia-1454980-r9-web.pdf (RTX A6000)"),
    Peak(r"rtx 6000 ada", 364.2, 364.2, 182.1, 91.1,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/design-visualization/rtx-6000/"
         "proviz-print-rtx6000-datasheet-web-2504660.pdf (RTX 6000 Ada)"),
    Peak(r"v100s", None, 130.0, None, 16.4,
         "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    Peak(r"v100.*pcie", None, 112.0, None, 14.0,
         "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    Peak(r"v100", None, 125.0, None, 15.7,
         "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    Peak(r"\bt4\b", None, 65.0, None, 8.1,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"),
    Peak(r"rtx 4090", 165.2, 165.2, 82.6, 82.6,
         "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (FP32 accumulate)"),
    Peak(r"rtx 4080(?! super)", 97.5, 97.5, 48.7, 48.7,
         "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf (FP32 accumulate)"),
    Peak(r"rtx 3090(?! ti)", 71.0, 71.0, 35.6, 35.6,
         "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf (FP32 "
         "accumulate)"),
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
