"""``GET /ui``: the page that asks, shows the sources and colours every prompt token by how the
blend computed it; plus the store's documents and the server's recent health.

The page is three files shipped in the package (``ui_assets/``: HTML, CSS, JS; no CDN, no build
step), served from memory with a Content-Security-Policy that allows only them: no inline
script or style, no other origin, no plugin, no framing. Everything it shows comes from the
public API (:mod:`.extensions`, chat completions with ``"token_map": true``), with the API key
the user types into the page (kept in the tab's ``sessionStorage``, sent as ``Authorization:
Bearer``). The files themselves hold no data, so they are served without the key; the API
behind them refuses without it. Document text reaches the page's DOM only as text
(``textContent``), never as HTML.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import RedirectResponse, Response

PAGE = "/ui"
ASSETS = {  # URL path -> (file in ui_assets/, media type)
    PAGE: ("index.html", "text/html; charset=utf-8"),
    f"{PAGE}/app.js": ("app.js", "text/javascript; charset=utf-8"),
    f"{PAGE}/app.css": ("app.css", "text/css; charset=utf-8"),
    f"{PAGE}/icon.svg": ("icon.svg", "image/svg+xml"),
}
PUBLIC_PATHS = (*ASSETS, f"{PAGE}/")  # served without the API key: no data in them
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}


def asset_bytes(name: str) -> bytes:
    return resources.files("blendkv.entrypoints.openai").joinpath("ui_assets", name).read_bytes()


def add_ui_routes(app: FastAPI) -> None:
    files = {path: (asset_bytes(name), media) for path, (name, media) in ASSETS.items()}

    def serve(path: str):
        body, media = files[path]

        async def asset() -> Response:
            return Response(body, media_type=media, headers=SECURITY_HEADERS)

        return asset

    for path in files:
        app.add_api_route(path, serve(path), methods=["GET", "HEAD"], include_in_schema=False)

    @app.get(f"{PAGE}/", include_in_schema=False)
    async def slash() -> Response:
        return RedirectResponse(PAGE, status_code=308)
