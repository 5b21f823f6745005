"""The machines a plan is for: a device table and the cluster around it.

A cluster is `nodes` nodes of `devices_per_node` devices, every device alike. Bandwidths are in
GB/s (10^9 bytes) in one direction, as the vendors give them:

    intra_node_gbs     device to device inside a node (NVLink), per device
    inter_node_gbs     a node's network (all its NICs together), shared by its devices
    host_link_gbs      device to host memory (PCIe), per device: what offloading crosses
    memory_gbs         device memory (HBM): the optimizer step and the element-wise kernels
    host_memory_gbs    a node's CPU memory: DeepSpeed's CPU Adam on offloaded partitions

Figures are datasheet peaks except the links, which are what a collective reaches in practice
(about 80% of the datasheet). `--gpu-memory-gib`, `--gpu-tflops` and the bandwidth flags describe
a device that is not in the table or correct one that is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

from megatron.training.metrics import PEAK_TFLOPS


@dataclass(frozen=True)
class Device:
    """One accelerator. `peak_tflops` by precision (dense, datasheet), from the training
    metrics' table so that the plan's MFU is the one the run logs."""

    name: str
    memory_gib: float
    peak_tflops: Dict[str, float]
    memory_gbs: float
    intra_node_gbs: float
    host_link_gbs: float
    inter_node_gbs: float
    """The node's network, default for a node of these devices."""
    host_memory_gib: float
    """A node's CPU memory, default for a node of these devices."""

    def tflops(self, precision: str) -> float:
        """Peak TFLOP/s at `precision` (a GPU without bf16 units runs bf16 at its fp32 rate;
        the planner does not propose it there: `plan_precision`)."""
        return self.peak_tflops.get(precision) or self.peak_tflops["fp32"]

    def supports(self, precision: str) -> bool:
        """Whether the device computes `precision` in hardware (V100: no bf16)."""
        return precision in self.peak_tflops


def _gpu(name, table_key, memory_gib, memory_gbs, nvlink, pcie, network, host_gib) -> Device:
    return Device(name, memory_gib, dict(PEAK_TFLOPS[table_key]), memory_gbs, nvlink, pcie,
                  network, host_gib)


# nvidia-smi's memory (MiB / 1024); NVLink per direction at 80% of the datasheet; PCIe Gen5 /
# Gen4 / Gen3 x16 at what a pinned copy reaches; the network of a typical node of 8 (H100: 8 x
# 400 Gb/s, A100: 8 x 200 Gb/s, V100: 4 x 100 Gb/s) at 80%.
DEVICES: Dict[str, Device] = {d.name: d for d in (
    _gpu("H100-80GB", "H100", 79.6, 3350.0, 360.0, 50.0, 320.0, 2048.0),
    _gpu("H200-141GB", "H200", 140.4, 4800.0, 360.0, 50.0, 320.0, 2048.0),
    _gpu("H800-80GB", "H800", 79.6, 3350.0, 160.0, 50.0, 320.0, 2048.0),
    _gpu("A100-80GB", "A100", 80.0, 2039.0, 240.0, 25.0, 160.0, 1024.0),
    _gpu("A100-40GB", "A100", 40.0, 1555.0, 240.0, 25.0, 160.0, 1024.0),
    _gpu("A800-80GB", "A800", 80.0, 2039.0, 160.0, 25.0, 160.0, 1024.0),
    _gpu("V100-32GB", "V100", 32.0, 900.0, 120.0, 12.0, 40.0, 512.0),
    _gpu("L40S-48GB", "L40S", 44.4, 864.0, 25.0, 25.0, 80.0, 512.0),
)}


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `devices_per_node` devices (`device`), and each node's host resources."""

    nodes: int
    devices_per_node: int
    device: Device
    inter_node_gbs: float
    host_memory_gib: float
    host_memory_gbs: float = 200.0
    nvme_gib: Optional[float] = None
    """A node's NVMe for ZeRO-Infinity (None: no NVMe offload is planned)."""
    nvme_gbs: float = 6.0
    """A node's NVMe read/write bandwidth."""
    device_type: str = "cuda"
    """'cuda', or 'cpu' for the processes of a CPU machine (the memory estimate's resident
    model, gloo)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def describe(self, precision: str) -> str:
        """One line: the devices, their peak at `precision` (the plan's), links and host."""
        d = self.device
        nvme = f", NVMe {self.nvme_gib:g} GiB" if self.nvme_gib else ""
        return (f"{self.nodes} node(s) x {self.devices_per_node} {d.name} ({d.memory_gib:g} GiB, "
                f"{d.tflops(precision):g} TFLOP/s {precision} peak); NVLink "
                f"{d.intra_node_gbs:g} GB/s, "
                f"network {self.inter_node_gbs:g} GB/s per node, host "
                f"{self.host_memory_gib:g} GiB per node{nvme}")


PRESET = re.compile(r"^(\d+)x(\d+)x(.+)$")


def device_named(name: str) -> Device:
    """A table entry by name, case and '-'/'_' insensitive ("h100-80gb", "H100_80GB").

    Raises:
        ValueError: not in the table (the message lists it).
    """
    key = re.sub(r"[-_ ]", "", name).lower()
    for known, device in DEVICES.items():
        if re.sub(r"[-_ ]", "", known).lower() == key:
            return device
    raise ValueError(f"unknown device {name!r}: known are {', '.join(DEVICES)} (or describe it "
                     f"with --gpu-memory-gib and --gpu-tflops)")


def custom_device(base: Optional[Device], memory_gib: Optional[float],
                  tflops: Optional[float], name: str = "custom") -> Device:
    """`base` with the given memory and peak (`tflops` for every precision it computes: a V100
    stays without bf16); without a base both are required, it computes bf16, fp16 and fp32, and
    the links are an H100 node's.

    Raises:
        ValueError: no base and not both figures (the message lists the table).
    """
    if base is None:
        if memory_gib is None or tflops is None:
            raise ValueError(f"--gpu is missing: give one of {', '.join(DEVICES)} (or "
                             f"--cluster NODESxGPUSxDEVICE), or describe a device not in the "
                             f"table with both --gpu-memory-gib and --gpu-tflops")
        base = replace(DEVICES["H100-80GB"], name=name,
                       peak_tflops=dict.fromkeys(("bf16", "fp16", "fp32"), 0.0))
    if memory_gib is not None:
        base = replace(base, memory_gib=memory_gib)
    if tflops is not None:
        base = replace(base, peak_tflops=dict.fromkeys(base.peak_tflops, tflops))
    return base


def plan_precision(device: Device, asked: Optional[str]) -> Tuple[str, Optional[str]]:
    """The precision to plan for and a note saying why when the device chose it: `asked`, or
    without one bf16 where the device has it, else fp16 (V100).

    Raises:
        ValueError: `asked` is one the device does not compute in hardware (bf16 on a V100:
            emulated, far below any peak, so no plan for it is worth proposing).
    """
    if asked is not None:
        if not device.supports(asked):
            has = ", ".join(p for p in ("bf16", "fp16", "fp32") if device.supports(p))
            raise ValueError(f"--precision {asked}: {device.name} has no {asked} support "
                             f"(it computes {has}); plan with one of those")
        return asked, None
    if device.supports("bf16"):
        return "bf16", None
    return "fp16", (f"fp16: {device.name} has no bf16 support, so bf16 is not proposed "
                    f"(fp16 trains with a dynamic loss scale)")
