"""The CUDA runtime library this process already loaded (torch's), located in one place.

Maru calls a few libcudart functions through ctypes (host registration, raw events and copies);
they must go to the runtime and context torch uses, never to a second copy found on disk.
"""

from __future__ import annotations


def find_cudart() -> str:
    """Path of the libcudart mapped into this process; ``OSError`` when none is loaded."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart" in line:
                return line.split()[-1]
    raise OSError("libcudart is not loaded in this process (import torch and initialise CUDA first)")
