"""``GET /console``: the operator's web page of the loop, served from files shipped in the package.

The page (``runtime/console/assets/``: ``index.html``, ``console.css``, ``charts.js``, ``console.js``;
plain JS and CSS, no build step, nothing fetched from elsewhere) asks for the admin key, keeps it in
the browser's ``sessionStorage`` and reads the admin API's own JSON (``/admin/adapters``,
``/admin/experiments``, ``/admin/learner``, ``/admin/traffic``, ``/admin/trajectories``, ...): the
page holds no data and no key; without a valid key it shows nothing but the key prompt.

Recorded messages are untrusted text. The page only ever inserts them as text nodes, and every file
is served with a Content-Security-Policy that allows scripts, styles and requests to this origin only
(no inline script, no ``eval``, no framing), so a stored message cannot run code with the admin key.

Not here: the data (the admin routes), the standalone report (``python -m learner report``).
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from runtime.errors import APIError

ASSETS = resources.files("runtime.console") / "assets"
_TYPES = {"index.html": "text/html; charset=utf-8", "console.css": "text/css; charset=utf-8"}
_TYPES |= {"charts.js": "text/javascript; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def asset(name: str) -> bytes:
    return (ASSETS / name).read_bytes()


router = APIRouter()


@router.get("/console", include_in_schema=False)
async def console() -> Response:
    return Response(asset("index.html"), media_type=_TYPES["index.html"], headers=HEADERS)


@router.get("/console/", include_in_schema=False)
async def console_slash() -> Response:
    return RedirectResponse("/console")


@router.get("/console/{name}", include_in_schema=False)
async def console_asset(name: str) -> Response:
    if name not in _TYPES or name == "index.html":  # a fixed list: no path from the request reaches the file system
        raise APIError(404, f"no console file {name!r}", code="not_found")
    return Response(asset(name), media_type=_TYPES[name], headers=HEADERS)
