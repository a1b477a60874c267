"""One route table (kvstreamd/routes.py): the app serves exactly its routes, each with its handler,
and the README's API list and node/api.py's docstring name the same routes, no more, no fewer."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvstreamd.node import api
from kvstreamd.routes import BY_NAME, ROUTES, request

ROOT = Path(__file__).resolve().parents[1]
TABLE = {(r.method, r.path) for r in ROUTES}
ROUTE = re.compile(r"\b(GET|POST|DELETE)\s+(/[\w/{}]*)")


def test_the_app_serves_every_route_of_the_table_and_no_other():
    app = api.make_app(node=None)
    served = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert served == TABLE


def test_api_docstring_lists_the_table():
    assert set(ROUTE.findall(api.__doc__)) == TABLE


def test_the_readme_api_list_is_the_table():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### The API, for the model process"):].split("\n\n")
    listed = section[1]  # the paragraph under the heading, which lists the routes
    # "`GET`/`POST /v1/pins`" names two routes of one path
    listed = re.sub(r"`(GET|POST|DELETE)`/`(GET|POST|DELETE) (/[\w/{}]*)`", r"`\1 \3`, `\2 \3`", listed)
    assert set(ROUTE.findall(listed)) == TABLE


def test_a_request_fills_in_its_path_parameters():
    assert request("unpin", key="ab12") == ("DELETE", "/v1/pins/ab12")
    assert request("status") == ("GET", "/v1/status")
    assert request("release_buffer", name="kvstreamd-1-abc") == ("DELETE", "/v1/buffers/kvstreamd-1-abc")
    with pytest.raises(KeyError):
        request("delete_context")  # {key} not given
    assert len(BY_NAME) == len(ROUTES)
