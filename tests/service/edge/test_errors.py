"""Every error the service answers has one code and one status, from one table."""

import re
from pathlib import Path

from padim.models.errors import OUTCOMES
from padim.service.edge.errors import SERVICE_CODES, STATUS, ApiError
from padim.service.edge.openapi import _WHY

SERVICE = Path(__file__).resolve().parents[3] / "service"


def test_a_code_is_the_librarys_or_the_services_never_both():
    library = [row.code for row in OUTCOMES.values()]
    assert len(library) == len(set(library)) and not set(library) & set(SERVICE_CODES)


def test_every_code_the_service_raises_has_its_status_in_the_table():
    raised = set()
    for path in SERVICE.rglob("*.py"):
        raised |= set(re.findall(r'ApiError\(\s*"([a-z_]+)"', path.read_text()))
    assert raised and raised <= set(STATUS), sorted(raised - set(STATUS))
    assert ApiError("timeout", "slow").status == 504 and ApiError("record_not_found", "gone").status == 404


def test_the_openapi_document_names_every_service_code_under_its_status():
    missing = [code for code, status in SERVICE_CODES.items() if status in _WHY and f"`{code}`" not in _WHY[status]]
    assert not missing
