"""Paths of the topology fixtures (tests/fixtures/topology, sources in its SOURCES.md)."""

from pathlib import Path

FIX = Path(__file__).parent / "fixtures" / "topology"
SMI = FIX / "nvidia-smi"
DGX = SMI / "dgx-a100-8gpu-nv12-10nic-legend-epyc7742-driver525-tabs.txt"
H100 = SMI / "h100-sxm-8gpu-nv18-no-nics-dual-numa-with-prompt.txt"
LEONARDO = SMI / "leonardo-4x-a100-sxm-64gb-nv4-mesh-4nic-slurm-cpuset.txt"
PCIE = SMI / "pcie-4gpu-dual-socket-pxb-pix-sys-no-nvlink-tabs.txt"
CONSUMER = SMI / "consumer-2gpu-pcie-phb-no-nvlink.txt"
CUBE = FIX / "synthetic" / "nvidia-smi-hybrid-cube-mesh-8gpu-nv1-nv2-gpu-numa-id.txt"
OLD = FIX / "synthetic" / "nvidia-smi-4gpu-3nic-old-driver-device-names.txt"
ROCE_ONLY = FIX / "synthetic" / "ibstat-two-ib-down-one-roce-up.txt"
IBSTAT = FIX / "ibstat" / "ibstat-connectx3-mlx4_0-single-port-active-fdr.txt"
# a node whose two NICs sit next to GPU3 (mlx5_0) and GPU6 (mlx5_1) only, all GPUs NV12
TWO_NIC = FIX / "synthetic" / "nvidia-smi-8gpu-nv12-2nic-pix-to-gpu3-and-gpu6-only.txt"
TWO_NIC_IBSTAT = FIX / "synthetic" / "ibstat-mlx5_0-mlx5_1-edr-100-active.txt"
GB200 = FIX / "synthetic" / "nvidia-smi-gb200-tray-4gpu-nv18-6nic-sys-after-sglang-11208.txt"
NVL72_BLOCKS = FIX / "synthetic" / "topology-block-two-nvl72-racks.conf"
