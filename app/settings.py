# kept for app/ui during the split; lead removes it
from compute.contract.settings import Settings, get_settings  # noqa: F401

__all__ = ["Settings", "get_settings"]
