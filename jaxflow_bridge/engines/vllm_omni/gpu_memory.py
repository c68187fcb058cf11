"""The GPU memory the engine's sleep frees, read device-wide with nvidia-smi: vLLM-Omni 0.20's sleep acknowledgement
reports 0 freed bytes (its accounting reads torch's allocator, which does not see the sleep pool), and the actor
holds no CUDA context of its own to ask."""
from __future__ import annotations

import os
import subprocess


def gpu_memory_used(visible: str | None = None) -> int | None:
    """Bytes in use on this process's first visible GPU (`visible`, else CUDA_VISIBLE_DEVICES), device-wide, or None
    where it cannot be read."""
    first = (os.environ.get("CUDA_VISIBLE_DEVICES", "0") if visible is None else visible).split(",")[0].strip()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", first],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return int(out.split()[0]) * 2 ** 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
