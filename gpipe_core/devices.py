"""Descriptions of accelerators and their links, and the bytes an optimizer keeps per parameter.

A :class:`Device` turns counted work into seconds: a layer of ``flops`` FLOPs and ``ops``
operator calls takes ``ops * op_overhead + flops / (peak_flops * achievable)``, so the
achievable fraction of peak falls for small per-layer work (tiny micro-batches) along
``achievable * w / (w + ops * op_overhead * peak_flops * achievable)``; a message of ``n`` bytes
to the neighbouring stage takes ``link_latency + n / link_bandwidth``. With a
``memory_bandwidth``, the bytes moved by the operators that do no counted FLOPs (element-wise
work, normalisation, pooling: ``LayerCosts.forward_traffic_bytes``) add
``traffic / memory_bandwidth``; the presets leave it 0 (not priced: a fused accelerator
program hides most of it, and the paper-scale predictions are made without it), a CPU core,
where a BatchNorm or a pooling costs as much as a convolution, needs it.

Presets (``DEVICES``), with their sources. Peak FLOP/s are the vendor's dense numbers for the
dtype the paper's runs (or current practice) use; ``achievable`` is one published end-to-end
model-FLOPs utilisation, not fitted to any table this project predicts:

- ``tpu_v2``, ``tpu_v3``: one TensorCore (the paper's "accelerator"): 8 GiB and 16 GiB HBM,
  22.5 and 61.5 TFLOP/s bf16 (half of a chip's 45 and 123), inter-chip links of 496 and
  656 Gbit/s (Jouppi et al., "A domain-specific supercomputer for training deep neural
  networks", CACM 2020, Table 3).
- ``p100``: Tesla P100 PCIe 16 GB, 9.3 TFLOP/s fp32 (NVIDIA P100 datasheet); "without
  NVLink" in the paper: PCIe 3.0 x16, 16 GB/s per direction, ~12 GB/s achieved.
- ``p40``: Tesla P40, 24 GB, 11.8 TFLOP/s fp32, PCIe 3.0 x16 (NVIDIA P40 datasheet).
- ``a100_80gb``: 80 GB, 312 TFLOP/s bf16 dense, NVLink 3 600 GB/s both directions (A100
  datasheet); ``h100_80gb``: H100 SXM, 80 GB, 989 TFLOP/s bf16 dense, NVLink 4 900 GB/s;
  ``h200``: 141 GB, same compute and NVLink as H100 (H100 / H200 datasheets).

``achievable`` = 0.5 for every preset: Megatron-LM's 52% of A100 peak end to end
(Narayanan et al., SC 2021, 163 of 312 TFLOP/s for GPT models on 3072 A100s) and
PaLM's 46% MFU on TPU v4 (Chowdhery et al. 2022) put large, well-tuned models near half of
peak. ``op_overhead``: a kernel launch, ~5 microseconds on NVIDIA GPUs (CUDA launch latency
as commonly measured, e.g. the CUDA Graphs documentation's motivation); 2 microseconds on
TPUs, whose XLA programs fuse element-wise operators. Link latency: 10 microseconds (PCIe /
NVLink point-to-point send through NCCL; ICI hops are shorter).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Device", "DEVICES", "OPTIMIZER_BYTES", "get_device", "bytes_per_parameter"]

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One accelerator and its link to the neighbouring stage's."""

    name: str
    memory_bytes: float  # usable by the model (parameters, optimizer state, activations)
    peak_flops: float  # FLOP/s for the training dtype
    achievable: float = 0.5  # fraction of peak reached on large per-layer work
    op_overhead: float = 5e-6  # seconds per operator call (launch, or per-op fixed cost)
    link_bandwidth: float = 12 * GB  # bytes/s to the neighbouring stage, one direction
    link_latency: float = 10e-6  # seconds per message
    source: str = ""
    # bytes/s of the operators without counted FLOPs; 0: their traffic is not priced
    memory_bandwidth: float = 0.0
    # what a message between two ranks takes from each end's own compute (a transport that
    # copies on the cores, gloo over loopback): seconds per message and bytes/s; a bandwidth
    # of 0: nothing (a link with its own engine, NCCL's copy kernels aside)
    message_overhead: float = 0.0
    message_bandwidth: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.achievable <= 1:
            raise ValueError(f"achievable={self.achievable} must be a fraction of peak in (0, 1]")
        for name in ("memory_bytes", "peak_flops", "link_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.message_overhead < 0 or self.message_bandwidth < 0:
            raise ValueError(f"message_overhead={self.message_overhead} and message_bandwidth="
                             f"{self.message_bandwidth} must be >= 0 (a bandwidth of 0: messages "
                             "take nothing from the ranks' compute)")
        if self.memory_bandwidth < 0:
            raise ValueError(f"memory_bandwidth={self.memory_bandwidth} must be bytes/s >= 0 "
                             "(0: the traffic of operators without FLOPs is not priced)")

    def compute_seconds(self, flops: float, ops: float = 0.0, traffic: float = 0.0) -> float:
        """Seconds for ``flops`` FLOPs spread over ``ops`` operator calls, and ``traffic``
        bytes moved by the calls without counted FLOPs (priced with a ``memory_bandwidth``)."""
        moved = traffic / self.memory_bandwidth if self.memory_bandwidth else 0.0
        return ops * self.op_overhead + flops / (self.peak_flops * self.achievable) + moved

    def utilisation(self, flops: float, ops: float) -> float:
        """The fraction of peak a layer of this work reaches (the curve against work)."""
        seconds = self.compute_seconds(flops, ops)
        return flops / (seconds * self.peak_flops) if seconds > 0 else 0.0

    def transfer_seconds(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` to the neighbouring stage (0 bytes: no message)."""
        return self.link_latency + nbytes / self.link_bandwidth if nbytes > 0 else 0.0

    def message_cpu_seconds(self, nbytes: float) -> float:
        """Seconds of each end's compute a message of ``nbytes`` takes (0 without a
        ``message_bandwidth``, or without bytes)."""
        if not self.message_bandwidth or nbytes <= 0:
            return 0.0
        return self.message_overhead + nbytes / self.message_bandwidth

    def with_memory(self, memory_bytes: float) -> Device:
        return replace(self, memory_bytes=memory_bytes)


DEVICES: dict[str, Device] = {
    "tpu_v2": Device("tpu_v2", 8 * GiB, 22.5e12, op_overhead=2e-6,
                     link_bandwidth=496e9 / 8, source="Jouppi et al. CACM 2020, one core"),
    "tpu_v3": Device("tpu_v3", 16 * GiB, 61.5e12, op_overhead=2e-6,
                     link_bandwidth=656e9 / 8, source="Jouppi et al. CACM 2020, one core"),
    "p100": Device("p100", 16 * GiB, 9.3e12, link_bandwidth=12 * GB,
                   source="P100 PCIe datasheet, fp32, no NVLink"),
    "p40": Device("p40", 24 * GiB, 11.8e12, link_bandwidth=12 * GB,
                  source="P40 datasheet, fp32, PCIe 3.0"),
    "a100_80gb": Device("a100_80gb", 80 * GB, 312e12, link_bandwidth=300 * GB,
                        source="A100 datasheet, bf16 dense, NVLink 3"),
    "h100_80gb": Device("h100_80gb", 80 * GB, 989e12, link_bandwidth=450 * GB,
                        source="H100 SXM datasheet, bf16 dense, NVLink 4"),
    "h200": Device("h200", 141 * GB, 989e12, link_bandwidth=450 * GB,
                   source="H200 datasheet, bf16 dense, NVLink 4"),
}

# Bytes per fp32 parameter during training: the weight (4), its gradient (4) and the
# optimizer's state.
OPTIMIZER_BYTES: dict[str, float] = {
    "sgd": 8.0,  # no state
    "momentum": 12.0,  # one velocity
    "rmsprop": 12.0,  # one mean square (the paper's AmoebaNet table: 12 bytes per parameter)
    "rmsprop_momentum": 16.0,  # mean square and momentum (torch's RMSprop with momentum > 0)
    "adam": 16.0,  # first and second moments
    "adafactor": 8.0,  # factored second moment: O(rows + cols) per matrix, ~0 per parameter
    "adafactor_momentum": 12.0,  # plus a first moment
}


def get_device(name: str) -> Device:
    """A preset by name, e.g. ``"h100_80gb"``."""
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; presets: {', '.join(DEVICES)}, or build "
                         "gp.Device(name, memory_bytes, peak_flops, ...)") from None


def bytes_per_parameter(optimizer: str | float) -> float:
    """Training bytes per parameter for an optimizer name or a number of bytes."""
    if isinstance(optimizer, (int, float)):
        return float(optimizer)
    try:
        return OPTIMIZER_BYTES[optimizer]
    except KeyError:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_BYTES)},"
                         " or give the bytes per parameter as a number") from None
