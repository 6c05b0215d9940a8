"""gputrace: explains GPU idle gaps by joining eBPF, CUPTI and NVML on one clock."""

__version__ = "0.1.0"


def import_root() -> str:
    """The directory this package is imported from: what a helper run with ``python -I`` puts on its sys.path."""
    import os

    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
