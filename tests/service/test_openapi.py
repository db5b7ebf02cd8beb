"""The OpenAPI document tells the truth: Schemathesis, every check, against a live server.

A bounded run (a fixed seed, 25 examples per operation): with no key configured, with a key
sent, and with a key configured but not sent (every protected route must then answer the
documented 401). Settings: tests/service/schemathesis.toml (one documented tolerance).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helpers import running_server

CONFIG = Path(__file__).with_name("schemathesis.toml")
SCHEMATHESIS = Path(sys.executable).with_name("st")


def schemathesis(url: str, workdir: Path, *options: str) -> subprocess.CompletedProcess:
    """``st run`` in ``workdir``: a fresh Hypothesis database, so a run does not depend on earlier ones."""
    return subprocess.run(
        [str(SCHEMATHESIS), "--config-file", str(CONFIG), "run", url + "/openapi.json", "--checks", "all",
         "--max-examples", "25", "--seed", "20261122", "--workers", "2", *options],
        capture_output=True, text=True, timeout=600, cwd=workdir)


@pytest.mark.parametrize("key, sent", [(None, False), ("s3cret", True), ("s3cret", False)],
                         ids=["no-key", "key-sent", "key-configured-not-sent"])
def test_schemathesis_finds_no_failure(model_file, tmp_path, key, sent):
    env = {"PADIM_API_KEY": key} if key else {}
    with running_server(tmp_path, [model_file], env=env) as srv:
        result = schemathesis(srv.url, tmp_path, *(["--header", f"X-API-Key: {key}"] if sent else []))
        logs = srv.logs()
    assert result.returncode == 0, result.stdout[-6000:]
    summary = result.stdout[result.stdout.rindex("SUMMARY"):]
    assert "Failures:" not in summary, summary
    generated, passed = map(int, re.search(r"(\d+) generated, (\d+) passed", summary).groups())
    assert generated == passed > 0, summary
    warnings = re.findall(r"⚠️ (.+)", summary)
    if key and not sent:  # the protected routes all answered 401, as documented
        assert "Authentication failed: 6 operations returned only 401/403 responses" in warnings, summary
    # Warnings are not failures; the only other one allowed is the known one: bytes that fit
    # `format: binary` are mostly not images, so a score route rejects most generated bodies.
    explained = re.compile(r"Authentication failed: 6 operations returned only 401/403 responses"
                           r"|Schema validation mismatch: [1-3] operations? mostly rejected generated data")
    assert all(explained.fullmatch(w.strip()) for w in warnings), summary
    assert "Traceback" not in logs


def test_document_declares_errors_security_and_raw_bodies(model_file, tmp_path):
    with running_server(tmp_path, [model_file], env={"PADIM_API_KEY": "k", "PADIM_MAX_QUEUE": "4"}) as srv:
        keyed = httpx.get(srv.url + "/openapi.json").json()
    with running_server(tmp_path, [model_file]) as srv:
        open_ = httpx.get(srv.url + "/openapi.json").json()
    score = keyed["paths"]["/score"]["post"]
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for status in ("401", "404", "408", "413", "415", "422", "500", "503", "504"):
        assert score["responses"][status]["content"]["application/json"]["schema"] == error, status
    assert "Retry-After" in score["responses"]["503"]["headers"]
    assert set(score["requestBody"]["content"]) == {"multipart/form-data", "image/*", "application/octet-stream"}
    assert score["security"] == [{"ApiKey": []}, {"Bearer": []}]
    assert keyed["components"]["securitySchemes"]["ApiKey"] == {
        "type": "apiKey", "in": "header", "name": "X-API-Key", "description": "PADIM_API_KEY"}
    assert "security" not in keyed["paths"]["/health/ready"]["get"]  # always open
    batch_file = keyed["paths"]["/score/batch"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert batch_file["schema"]["properties"]["file"]["maxItems"] == 4  # min(max_batch_size, max_queue)
    assert "HTTPValidationError" not in keyed["components"]["schemas"]
    # no key configured: none declared (a scheme the server does not check would be a lie)
    assert "securitySchemes" not in open_["components"] and "security" not in open_["paths"]["/score"]["post"]
    assert "401" not in open_["paths"]["/score"]["post"]["responses"]
