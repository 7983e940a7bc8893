"""What steplens knows of each device, in one table keyed by device (peak table v3): its dense peak FLOP/s per dtype
(MFU's peak), its memory bandwidth (the roofline's memory roof) and its whole interconnect bandwidth (the bound
sanity holds bus bandwidths to), each with its source; and how a device name maps to a key.

Peaks are the DENSE datasheet rates (the sparsity figure halved where the sheet quotes sparsity), as collected and
cross-checked in ../shared/reference/anchors-mfu-comms-peers.md §1 (Lightning throughput.py, composer
speed_monitor.py, torchtitan tools/utils.py, PyTorch inductor device_info.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PEAK_TABLE_VERSION = 3  # 2: memory bandwidth for the roofline; 3: interconnect bandwidth in the same table


@dataclass(frozen=True)
class Device:
    peak_tflops: dict[str, float]  # dense TFLOP/s per dtype
    peak_source: str
    hbm_tbps: float | None  # memory bandwidth, TB/s (1e12 B/s); None: depends on the variant (A100_HBM_RULES)
    hbm_source: str
    link_gbps: float  # whole interconnect per GPU, GB/s, both directions
    link_source: str


DEVICES: dict[str, Device] = {
    "h100-sxm": Device({"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "tf32": 494.5, "fp32": 67.0},
                       "NVIDIA H100 datasheet, SXM5 column (dense)", 3.35, "NVIDIA H100 datasheet, SXM5: 3.35 TB/s HBM3",
                       900.0, "NVIDIA H100 datasheet: NVLink 900 GB/s"),
    "h100-pcie": Device({"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.2},
                        "NVIDIA H100 datasheet, PCIe column (dense)", 2.0, "NVIDIA H100 datasheet, PCIe: 2 TB/s HBM2e",
                        600.0, "NVIDIA H100 PCIe datasheet: NVLink bridge 600 GB/s (PCIe Gen5 128 GB/s)"),
    "h100-nvl": Device({"bf16": 835.5, "fp16": 835.5, "fp8": 1671.0, "tf32": 417.5, "fp32": 60.0},
                       "NVIDIA H100 NVL datasheet (dense = sparse / 2)", 3.9, "NVIDIA H100 NVL datasheet: 3.9 TB/s",
                       600.0, "NVIDIA H100 NVL datasheet: NVLink bridge 600 GB/s"),
    "h200-sxm": Device({"bf16": 989.5, "fp16": 989.5, "fp8": 1979.0, "tf32": 494.5, "fp32": 67.0},
                       "NVIDIA H200 datasheet, SXM column (dense; same tensor cores as H100 SXM)", 4.8,
                       "NVIDIA H200 datasheet, SXM: 4.8 TB/s HBM3e", 900.0, "NVIDIA H200 datasheet: NVLink 900 GB/s"),
    "h200-nvl": Device({"bf16": 835.5, "fp16": 835.5, "fp8": 1671.0, "tf32": 417.5, "fp32": 60.0},
                       "NVIDIA H200 NVL datasheet (dense)", 4.8, "NVIDIA H200 datasheet, NVL: 4.8 TB/s HBM3e",
                       900.0, "NVIDIA H200 NVL datasheet: NVLink bridge 900 GB/s"),
    "b200": Device({"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1125.0, "fp32": 75.0},
                   "NVIDIA DGX B200 / HGX B200 datasheet per GPU (dense = sparse / 2)", 8.0,
                   "NVIDIA HGX B200 datasheet: 8 TB/s per GPU", 1800.0, "NVIDIA B200 datasheet: NVLink 5 1.8 TB/s"),
    "a100": Device({"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
                   "NVIDIA A100 datasheet (SXM and PCIe equal for tensor rates; dense)", None, "",
                   600.0, "NVIDIA A100 datasheet: NVLink 600 GB/s"),
    "mi300x": Device({"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4},
                     "AMD Instinct MI300X datasheet (dense, not the measured max-achievable figure)", 5.3,
                     "AMD Instinct MI300X datasheet: 5.3 TB/s HBM3", 896.0,
                     "AMD Instinct MI300X datasheet: 7 Infinity Fabric links x 128 GB/s"),
    "v100-sxm": Device({"fp16": 125.0, "fp32": 15.7},
                       "NVIDIA V100 datasheet, SXM2 column: fp16 Tensor Core, fp32 single precision", 0.9,
                       "NVIDIA V100 datasheet, SXM2: 900 GB/s", 300.0, "NVIDIA V100 datasheet: NVLink 300 GB/s"),
    "v100-pcie": Device({"fp16": 112.0, "fp32": 14.0},
                        "NVIDIA V100 datasheet, PCIe column: fp16 Tensor Core, fp32 single precision", 0.9,
                        "NVIDIA V100 datasheet, PCIe: 900 GB/s", 32.0, "NVIDIA V100 datasheet: PCIe Gen3 32 GB/s"),
    "v100s-pcie": Device({"fp16": 130.0, "fp32": 16.4},
                         "NVIDIA V100S datasheet: fp16 Tensor Core, fp32 single precision", 1.134,
                         "NVIDIA V100S datasheet: 1134 GB/s", 32.0, "NVIDIA V100S datasheet: PCIe Gen3 32 GB/s"),
    "l4": Device({"bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "tf32": 60.0, "fp32": 30.3},
                 "NVIDIA L4 datasheet (dense = sparse / 2)", 0.3, "NVIDIA L4 datasheet: 300 GB/s GDDR6",
                 64.0, "NVIDIA L4 datasheet: PCIe Gen4 x16 64 GB/s"),
    "a10g": Device({"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
                   "NVIDIA A10 datasheet rates, as Lightning uses for A10G (AWS publishes none of its own)", 0.6,
                   "NVIDIA A10 datasheet: 600 GB/s GDDR6 (as for FLOPs)", 64.0, "NVIDIA A10 datasheet: PCIe Gen4 64 GB/s"),
}
# A100 bandwidth differs by memory variant (40GB: 1.555, 80GB SXM: 2.039, 80GB PCIe: 1.935 TB/s), matched on the
# name's memory size; a bare "A100" gets no bandwidth.
A100_HBM_RULES: list[tuple[str, float, str]] = [
    (r"80GB.*PCIe|PCIe.*80GB", 1.935, "NVIDIA A100 datasheet, 80GB PCIe: 1,935 GB/s"),
    (r"80GB", 2.039, "NVIDIA A100 datasheet, 80GB SXM: 2,039 GB/s"),
    (r"40GB", 1.555, "NVIDIA A100 datasheet, 40GB (SXM and PCIe): 1,555 GB/s"),
]
FASTEST_LINK = max((d.link_gbps, d.link_source) for d in DEVICES.values())

# (key, name pattern, SM count or None). Checked in order; the SM count separates H100 SXM (132)
# from PCIe (114) when the name is bare "NVIDIA H100".
DEVICE_RULES: list[tuple[str, str, int | None]] = [
    ("h100-nvl", r"H100.*NVL", None),
    ("h100-pcie", r"H100.*(PCIe|PCIE|HBM2e)", None),
    ("h100-sxm", r"H100.*(SXM|HBM3)", None),
    ("h100-sxm", r"H100", 132),
    ("h100-pcie", r"H100", 114),
    ("h200-nvl", r"H200.*NVL", None),
    ("h200-sxm", r"H200", None),
    ("b200", r"B200", None),
    ("a100", r"A100", None),
    ("mi300x", r"MI300X", None),
    ("v100s-pcie", r"V100S", None),
    ("v100-pcie", r"V100.*PCIE", None),
    ("v100-sxm", r"V100.*SXM", None),
    ("l4", r"L4($|\s)", None),
    ("a10g", r"A10G", None),
]
# A model token starts a word: "NVIDIA GH200 480GB" (Grace Hopper) is no H200, "NVIDIA GB200" no B200.
MODEL_START = r"(?<![A-Za-z0-9])"


def match_device(name: str, num_sms: int | None = None) -> str | None:
    """The table's key for a device name (as in Kineto's deviceProperties), or None."""
    for key, pattern, sms in DEVICE_RULES:
        if re.search(MODEL_START + pattern, name, re.IGNORECASE) and (sms is None or sms == num_sms):
            return key
    return None


def peak_bandwidth(device_name: str | None, num_sms: int | None = None) -> tuple[float | None, str]:
    """Peak memory bandwidth in B/s and its label, or None and why there is no memory roof."""
    if not device_name:
        return None, "no device name in the traces: no memory roof"
    key = match_device(device_name, num_sms)
    if key == "a100":
        for pattern, tbps, source in A100_HBM_RULES:
            if re.search(pattern, device_name, re.IGNORECASE):
                return tbps * 1e12, f"{tbps:g} TB/s ({source})"
        return None, f"{device_name!r}: A100 bandwidth depends on the memory variant (40GB / 80GB), which the name does not say"
    if key is None or DEVICES[key].hbm_tbps is None:
        return None, f"unknown device {device_name!r}: no memory bandwidth in the peak table"
    device = DEVICES[key]
    return device.hbm_tbps * 1e12, f"{device.hbm_tbps:g} TB/s ({device.hbm_source})"
