"""``configured(preset, **changes)``: a preset with changed fields, kept valid for every preset."""

from __future__ import annotations

from typing import Any

from mhanum import Numerics


def configured(preset: str, **changes: Any) -> Numerics:
    """``Numerics.preset(preset).replace(**changes)``; tensor-core units sum their groups in
    order, so another summation order becomes ``"sequential"`` for them."""
    base = Numerics.preset(preset)
    if base.dot_kind == "tensor-core" and changes.get("summation") not in (None, "native"):
        changes["summation"] = "sequential"
    return base.replace(**changes)
