"""Sandgate in JupyterLab: a jupyter_server extension (this module and ``handlers``) and a
prebuilt Lab extension (``labextension/``, built from ``lab/src``).

The server part runs in the Lab server started with ``--gateway-url``. It calls the gateway's
sandbox API with that server's own GatewayClient (URL, token, headers, TLS settings), so the
browser talks only to the Lab server and never holds the gateway's token.
"""

from .handlers import setup_handlers

__version__ = "0.1.0"


def _jupyter_labextension_paths():
    return [{"src": "labextension", "dest": "sandgate-lab"}]


def _jupyter_server_extension_points():
    return [{"module": "sandgate_lab"}]


def _load_jupyter_server_extension(server_app):
    setup_handlers(server_app)
    server_app.log.info("sandgate_lab: the sandbox panel and workspace drive, at %s",
                        server_app.web_app.settings.get("base_url", "/") + "sandgate/")
