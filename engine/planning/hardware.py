"""GPU presets: memory, dense peak FLOP/s, HBM and link bandwidth, and an indicative price.

Peak FLOP/s are dense (no 2:4 sparsity: datasheets print the sparse figure, twice the dense one, first).
Memory is the datasheet capacity in GiB (HBM sizes are binary); the driver keeps a few hundred MiB of it,
which `gpu_memory_utilization` and the plan's headroom absorb. Link bandwidths are per GPU and per
direction, the figure a ring collective moves data at: NVLink's "900 GB/s" is 450 GB/s each way.
Inter-node bandwidth assumes one NIC per GPU, as in the DGX / HGX reference designs. Prices are
indicative on-demand cloud rates in USD per GPU-hour (late 2024), not datasheet figures: override them.
Every figure can be overridden by its own flag (`--gpu-memory-gib`, `--peak-tflops`, `--hbm-tbps`,
`--intra-node-gbps`, `--inter-node-gbps`, `--price-per-gpu-hour`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    bf16_tflops: float  # dense tensor-core peak, FP32 accumulate
    fp16_tflops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores
    hbm_tbps: float  # device memory bandwidth, TB/s
    intra_node_gbps: float  # GB/s per direction per GPU over NVLink / xGMI / PCIe
    link: str  # what intra_node_gbps crosses
    inter_node_gbps: float  # GB/s per direction per GPU across nodes (its NIC)
    price_per_gpu_hour: float  # USD, indicative

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for a training precision: mixed and bfloat16 run bf16 matmuls, float16 fp16 ones;
        float32 training runs TF32 tensor cores at half the bf16 rate (NVIDIA A100/H100 datasheets)."""
        if precision in ("float16", "fp16"):
            return self.fp16_tflops
        if precision in ("float32", "fp32"):
            return self.bf16_tflops / 2
        if precision == "fp8":
            if self.fp8_tflops is None:
                raise ValueError(f"{self.name} has no FP8 tensor cores")
            return self.fp8_tflops
        return self.bf16_tflops

    def with_overrides(self, **figures: float | None) -> GPU:
        return replace(self, **{k: v for k, v in figures.items() if v is not None})


GB_S_PCIE4, GB_S_PCIE5 = 32.0, 64.0  # x16, per direction
GPUS: dict[str, GPU] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 TF dense, HBM2 1,555 GB/s (40 GB) and
    # HBM2e 2,039 GB/s (80 GB SXM), NVLink 600 GB/s. Inter-node: DGX A100, 8 x 200 Gb/s HDR InfiniBand.
    "a100-40gb": GPU("A100 SXM 40GB", 40, 312, 312, None, 1.555, 300, "NVLink 3", 25, 1.30),
    "a100-80gb": GPU("A100 SXM 80GB", 80, 312, 312, None, 2.039, 300, "NVLink 3", 25, 1.80),
    # NVIDIA A800 80GB SXM (China export variant of the A100 80GB): same compute and HBM, NVLink cut to
    # 400 GB/s (NVIDIA A800 product brief). Price: not published outside China; set to A100's.
    "a800": GPU("A800 SXM 80GB", 80, 312, 312, None, 2.039, 200, "NVLink 3 (400 GB/s)", 25, 1.80),
    # NVIDIA H100 Tensor Core GPU datasheet: SXM BF16/FP16 1,979 TF and FP8 3,958 TF with sparsity
    # (989.5 / 1,979 dense), HBM3 3.35 TB/s, NVLink 900 GB/s; DGX H100: 8 x 400 Gb/s NDR (ConnectX-7).
    "h100-sxm": GPU("H100 SXM 80GB", 80, 989.5, 989.5, 1979, 3.35, 450, "NVLink 4", 50, 3.00),
    # Same datasheet, PCIe card: 1,513 / 3,026 TF sparse (756 / 1,513 dense), HBM2e 2.0 TB/s, PCIe Gen5
    # 128 GB/s (the NVLink bridge pairs only two cards, so a node of 8 talks over PCIe).
    "h100-pcie": GPU("H100 PCIe 80GB", 80, 756, 756, 1513, 2.0, GB_S_PCIE5, "PCIe Gen5", 25, 2.50),
    # H800 SXM (China export variant of the H100 SXM): same compute and HBM, NVLink 400 GB/s (NVIDIA H800
    # product brief; flagged: figures from NVIDIA's regional pages, not a global datasheet).
    "h800": GPU("H800 SXM 80GB", 80, 989.5, 989.5, 1979, 3.35, 200, "NVLink 4 (400 GB/s)", 50, 3.00),
    # NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e at 4.8 TB/s, compute as the H100 SXM.
    "h200": GPU("H200 SXM 141GB", 141, 989.5, 989.5, 1979, 4.8, 450, "NVLink 4", 50, 3.70),
    # NVIDIA HGX B200 datasheet, per GPU (eight per board): FP8 72 PF and BF16 36 PF sparse for the board
    # -> 4.5 PF / 2.25 PF dense per GPU; 1.44 TB HBM3e -> 180 GB; 62 TB/s -> 7.7 TB/s; NVLink 5 1.8 TB/s.
    "b200": GPU("B200 180GB", 180, 2250, 2250, 4500, 7.7, 900, "NVLink 5", 50, 6.00),
    # NVIDIA L40S datasheet: BF16/FP16 362.05 TF and FP8 733 TF dense (733 / 1,466 sparse), 48 GB GDDR6 at
    # 864 GB/s, PCIe Gen4 x16, no NVLink. Inter-node: 100 Gb/s Ethernet assumed.
    "l40s": GPU("L40S 48GB", 48, 362.05, 362.05, 733, 0.864, GB_S_PCIE4, "PCIe Gen4", 12.5, 1.00),
    # NVIDIA Ada Lovelace architecture whitepaper, Appendix A (GeForce RTX 4090): FP16/BF16 tensor 165.2 TF
    # with FP32 accumulate, FP8 330.3 TF (dense), 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4, no NVLink.
    "rtx-4090": GPU("GeForce RTX 4090 24GB", 24, 165.2, 165.2, 330.3, 1.008, GB_S_PCIE4, "PCIe Gen4", 12.5, 0.40),
    # AMD Instinct MI300X datasheet: 192 GB HBM3 at 5.3 TB/s, FP16/BF16 1,307.4 TF and FP8 2,614.9 TF dense,
    # Infinity Fabric 896 GB/s peer-to-peer (7 links x 64 GB/s each way = 448 GB/s per direction).
    "mi300x": GPU("Instinct MI300X 192GB", 192, 1307.4, 1307.4, 2614.9, 5.3, 448, "Infinity Fabric (xGMI)", 50,
                  3.50),
}


def gpu_preset(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}")
    return GPUS[name]
