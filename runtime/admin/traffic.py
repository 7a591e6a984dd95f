"""``GET /admin/traffic?minutes=60`` (admin key): the server's traffic over the last ``minutes`` (at most the history's
window), one point per interval; the shape is ``runtime/traffic.py``'s. A ``minutes`` outside that range is a 400.

Not here: keeping the history (``runtime/traffic.py``).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request

from runtime.errors import APIError
from runtime.identity import check_admin_key
from runtime.services import services

router = APIRouter()


@router.get("/admin/traffic")
async def admin_traffic(request: Request, minutes: float = 60.0) -> dict[str, Any]:
    s = services(request)
    check_admin_key(request, s.admin_key)
    traffic = s.traffic
    if not (math.isfinite(minutes) and 0 < minutes <= traffic.window_s / 60):
        raise APIError(400, f"minutes must be in (0, {traffic.window_s / 60:g}]", param="minutes", code="invalid_value")
    return traffic.series(minutes)
