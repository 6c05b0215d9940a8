"""Data sources: eBPF programs (bcc), the CUPTI agent conversion, NVML, libcuda uprobes."""
