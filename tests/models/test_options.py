"""Every option is declared once (models/options.py) and reaches, from there alone, the flags, the JSON, the
resume and merge checks, GET /models and the docs."""

import subprocess
import sys
from pathlib import Path

import pytest

from padim.cli import build_parser
from padim.models.config import CALIBRATION, PadimConfig
from padim.models.options import BEFORE, OPTIONS, given_flags, markdown_table

ROOT = Path(__file__).resolve().parents[2]

#: Tiles, for the one option that needs them (an overlap of tiles).
TILED = {"tiles": (2, 2)}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_an_option_reaches_the_flags_the_json_and_the_resume_check(name):
    declared = OPTIONS[name]
    base = PadimConfig(**TILED)
    # the flag: train parses another allowed value into the option, with the declaration's help
    args = build_parser().parse_args(["train", "data", "-o", "m.padim", *declared.other_value()])
    given = given_flags(args)
    assert set(given) == {name} and declared.option.help
    changed = base.replace(**given)
    assert changed.to_dict()[name] != base.to_dict()[name]
    # the model file's and the export's JSON: flat, by name, read back the same (D as built)
    stored = changed.stored(changed.embedding_dim_or_default())
    read = PadimConfig.from_stored(stored, "test", older=False).to_dict()
    assert read == {
        **changed.to_dict(),
        "embedding_dim": changed.embedding_dim_or_default(),
        "layers": changed.features.stages,
    }
    # the resume and merge check: group equality, no list kept by hand
    assert base.differences(changed, CALIBRATION) == ([name] if declared.group in CALIBRATION else [])


def test_the_served_description_shows_the_declared_options():
    from padim.service.edge.schemas import ModelDescription

    shown = {name for name, d in OPTIONS.items() if d.option.shown}
    assert shown <= set(ModelDescription.model_fields)
    for name in shown:
        assert ModelDescription.model_fields[name].description == OPTIONS[name].option.help


def test_a_file_older_than_an_option_is_read_with_what_it_computed():
    stored = PadimConfig().stored(100)
    for name in BEFORE:
        del stored[name]
    older = PadimConfig.from_stored(stored, "old", older=True)
    assert {name: older.to_dict()[name] for name in BEFORE} == BEFORE


def test_the_docs_table_is_the_declaration():
    text = (ROOT / "docs" / "training.md").read_text()
    start = text.index("<!-- options table")
    table = text[text.index("\n", start) + 1 : text.index("<!-- end of options table -->")]
    assert table == markdown_table(), "regenerate it: python -c 'from padim.models.options import markdown_table'"


def test_the_declaration_imports_no_torch():
    code = "import sys, padim.models.options\nprint(sorted(m for m in ('torch', 'numpy', 'PIL') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
