"""GPU layer: the runtime facade (``runtime``), its vendor backends, the compile cache and kernel checks.

Import ``hipengine.gpu.runtime`` for the API; the backends are loaded lazily by ``runtime.get_runtime``.
"""
from .runtime import DeviceBuffer, HostBuffer, Runtime, device_count, get_runtime

__all__ = ["DeviceBuffer", "HostBuffer", "Runtime", "device_count", "get_runtime"]
