"""``GET /admin/learner`` and ``POST /admin/learner/update``: the learner processes' state, through files.

The learner (``python -m learner run``) keeps ``<data-dir>/learner/<family>/status.json`` current;
this module serves those files and asks for an update by writing ``update.request`` next to them,
which the learner picks up within a second. Files keep the runtime free of learner imports and work
when the learner runs on another host that shares the data folder.

Not here: training (``learner/``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from runtime.errors import APIError
from runtime.http_body import read_json
from runtime.store_routes import check_admin_key

STALE_S = 120.0  # a status not refreshed for this long belongs to a learner that is not running


def _statuses(root: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(root.glob("*/status.json")):
        try:
            status = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:  # mid-replace on another host, or damaged: report, don't fail
            out.append({"family": path.parent.name, "state": "unknown", "detail": f"unreadable status: {exc}"})
            continue
        age = time.time() - float(status.get("updated_at", 0))
        status["running"] = status.get("state") != "stopped" and age < STALE_S
        status["status_age_s"] = round(age, 1)
        history = path.parent / "history.jsonl"
        status["history"] = [json.loads(line) for line in history.read_text().splitlines()[-20:] if line.strip()] if history.exists() else []
        out.append(status)
    return out


def install_learner_routes(app: FastAPI, data_dir: Path, admin_key: str | None, learner_enabled: bool) -> None:
    root = Path(data_dir) / "learner"

    @app.get("/admin/learner")
    async def learner_status(request: Request) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        return {"object": "list", "enabled": learner_enabled, "data": _statuses(root)}

    @app.post("/admin/learner/update", status_code=202)
    async def learner_update(request: Request) -> dict[str, Any]:
        check_admin_key(request, admin_key)
        body = await read_json(request) if int(request.headers.get("content-length") or 0) else {}
        family = body.get("family")
        families = [p.parent.name for p in root.glob("*/status.json")]
        if family is not None:
            if family not in families:
                raise APIError(404, f"no learner for family {family!r} (known: {', '.join(families) or 'none'})", param="family", code="not_found")
            families = [family]
        if not families:
            raise APIError(409, "no learner is running: start serve.py without --no-learner, or run python -m learner run", code="no_learner")
        for f in families:
            tmp = root / f / "update.request.tmp"
            tmp.write_text(json.dumps({"requested_at": time.time()}))
            os.replace(tmp, root / f / "update.request")
        return {"requested": families}
