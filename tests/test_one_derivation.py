"""Each value is worked out in one place, and the rest ask it (docs/layout.md, "where a change belongs").

Read from the sources (text and AST), as tests/test_layers.py reads the imports: a second derivation written later
fails here, naming where it is.
"""

from __future__ import annotations

import ast
import re

import pytest
from test_layers import MODULES, ROOT

SOURCES = {name: path.read_text() for name, path in MODULES.items()}


def _where(pattern: str) -> list[str]:
    return [f"{name}:{i + 1}" for name, text in SOURCES.items() for i, line in enumerate(text.splitlines())
            if re.search(pattern, line)]  # fmt: skip


def _modules_with(pattern: str) -> list[str]:
    """The module of each line matching ``pattern`` (a module twice for two lines)."""
    return [where.split(":")[0] for where in _where(pattern)]


def _assigned(target: str) -> list[str]:
    found = []
    for name, text in SOURCES.items():
        for node in ast.walk(ast.parse(text)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []  # fmt: skip
            if any(isinstance(t, ast.Name) and t.id == target for t in targets):
                found.append(name)
    return found


@pytest.mark.parametrize(
    "pattern",
    [
        r"0\.5 if [^#]* is None",  # the model's threshold worked out where a request names none
        r"is not None else 0\.5",
        r"[\"']threshold[\"']: 0\.5",  # written as a literal in an answer
        r"score\(.*\) >= 0\.5",
        r"threshold: float = 0\.5",
    ],
)
def test_the_models_threshold_is_worked_out_once(pattern):
    """core.calibration.threshold_at says what threshold a request scores at (MODEL_THRESHOLD when it names none);
    everything else asks it."""
    assert _where(pattern) == []
    assert "MODEL_THRESHOLD = 0.5" in SOURCES["padim.core.calibration"]


def test_the_image_scores_are_declared_once():
    assert _assigned("IMAGE_SCORES") == ["padim.core"]


def test_the_anomalous_area_is_counted_once():
    """padim.models.scoring.verdicts.pixels_over counts it for predict and for a scored batch on its device."""
    assert _modules_with(r"count_nonzero\(") == ["padim.models.scoring.verdicts"]
    assert "pixels_over(" in SOURCES["padim.service.device.batching"]
    assert _modules_with(r">= limits") == ["padim.models.scoring.verdicts"]


def test_the_spools_arithmetic_is_cores():
    """The comoment's products and Chan's merge are in padim.core.statistics; the fit's passes call them."""
    assert _modules_with(r"\.baddbmm_?\(") == ["padim.core.statistics"] * 2
    for name in ("padim.models.fit.first_pass", "padim.models.fit.finish"):
        assert not re.search(r"\.sum\(dim=0, dtype=", SOURCES[name]), name


def test_the_first_pass_is_handed_what_it_reads_with():
    """models/fit/first_pass.py takes the pictures, the fit's Reading and the statistics, and returns what it made:
    it names no Fit (nor the Fitting protocol) and calls nothing on one."""
    tree = ast.parse(SOURCES["padim.models.fit.first_pass"])
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args
    }
    assert not {"fit", "Fitting", "Fit"} & names


def test_the_score_routes_are_typed_with_the_one_surface():
    """Both owners name ScoreSurface as their base (mypy checks each against it: .ci/typecheck) and the score routes
    know no owner but through it."""
    from padim.service.processes.api import ApiState
    from padim.service.state import ScoreSurface, ServiceState

    assert ScoreSurface in ServiceState.__mro__ and ScoreSurface in ApiState.__mro__
    route = SOURCES["padim.service.routes.score"]
    assert "ServiceState" not in route and "ApiState" not in route and "ScoreSurface" in route


def test_core_keeps_a_table_of_contents_at_its_top():
    """At most twelve modules at the top of core/, as the other packages keep."""
    top = sorted(p.stem for p in (ROOT / "core").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 12, top
