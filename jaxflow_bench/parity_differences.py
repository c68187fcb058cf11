"""The algorithm parity benchmark's figures of one comparison: max abs and rel differences against a reference."""
from __future__ import annotations

import numpy as np


def differences(ours, theirs) -> dict:
    """max abs and rel difference of the loss and of the gradient (rel: over the reference's max |.|); ours and
    theirs are (loss, (gradient arrays...))."""
    (lo, go), (lt, gt) = ours, theirs
    g_abs = max(float(np.max(np.abs(a - b))) for a, b in zip(go, gt))
    g_scale = max(float(np.max(np.abs(b))) for b in gt)
    return {"loss_abs": abs(float(lo) - float(lt)), "loss_rel": abs(float(lo) - float(lt)) / abs(float(lt)),
            "grad_abs": g_abs, "grad_rel": g_abs / g_scale}


def array_differences(name: str, ours, theirs) -> dict:
    """{name_abs, name_rel}: max |ours - theirs| and that over the reference's max |.|."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    gap = float(np.max(np.abs(ours - theirs)))
    return {f"{name}_abs": gap, f"{name}_rel": gap / float(np.max(np.abs(theirs)))}
