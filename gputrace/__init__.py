"""gputrace: explains GPU idle gaps by joining eBPF, CUPTI and NVML on one clock."""

__version__ = "0.1.0"
