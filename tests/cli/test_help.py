"""What a newcomer reads first: ``train --help``'s first screen, every default said, the presets, the effective
options as YAML, one meaning per flag, and old spellings still read."""

from __future__ import annotations

import argparse

import pytest
import yaml
from helpers import run_cli

from padim.cli import build_parser
from padim.models.choices import presets
from padim.models.config import PadimConfig, read_config_file
from padim.models.options import ESSENTIAL, OPTIONS


def subparser(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def test_train_help_opens_with_the_common_options_and_their_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # a terminal's usual width; a wider one shows more
    first = subparser("train").format_help().splitlines()[:30]
    text = "\n".join(first)
    assert first[0] == "usage: padim train DATA_DIR --output MODEL [options]"
    for flag in ("DATA_DIR", "--output", "--config", "--print-config", *(OPTIONS[n].flag for n in ESSENTIAL)):
        assert flag in text, f"{flag} is not in the first 30 lines of train --help"
    for name in ESSENTIAL:  # each essential option's default, in its own lines
        at = next(i for i, line in enumerate(first) if line.lstrip().startswith(OPTIONS[name].flag))
        said = " ".join(first[at : at + 4])
        assert "default" in said, f"{OPTIONS[name].flag}: no default said in {said!r}"


def test_every_train_option_with_a_value_states_its_default():
    for action in subparser("train")._actions:
        if (
            not action.option_strings
            or action.help == argparse.SUPPRESS
            or action.required
            or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction, argparse._VersionAction))
        ):
            continue
        assert "default" in (action.help or ""), f"padim train {action.option_strings[0]}: no default in its help"


def test_workers_means_one_thing_and_old_spellings_still_parse():
    train = subparser("train")
    assert "--workers" not in train.format_help() and "--decode-workers" in train.format_help()
    assert "API processes" in next(a.help for a in subparser("serve")._actions if "--workers" in a.option_strings)
    for command in ("train", "predict", "evaluate"):
        words = {"train": ["d", "-o", "m"], "predict": ["m", "d", "-o", "o"], "evaluate": ["m", "d"]}[command]
        assert build_parser().parse_args([command, *words, "--workers", "3"]).decode_workers == 3  # before format 16
    assert build_parser().parse_args(["export", "m", "-o", "o", "--precision", "fp32"]).precision == "fp32"
    assert build_parser().parse_args(["export", "m", "-o", "o", "--precision", "float32"]).precision == "fp32"


def test_the_presets_ship_with_the_package_and_are_named_by_config():
    assert set(presets()) >= {"paper", "resnet18", "wide_resnet50_2", "demo"}
    paper, given = read_config_file("paper")
    assert paper.gaussian.neighbourhood == 1 and paper.gaussian.shrinkage == 0 and "neighbourhood" in given
    with pytest.raises(ValueError, match="not a preset; the presets: demo, paper"):
        read_config_file("papr")


def test_print_config_prints_the_effective_options_as_the_yaml_config_reads(tmp_path):
    result = run_cli(
        "train", tmp_path / "nowhere", "-o", tmp_path / "m.padim", "--config", "paper", "--shrinkage", "0.2",
        "--print-config",
    )  # fmt: skip
    assert not (tmp_path / "m.padim").exists()  # printed, nothing fitted
    printed = yaml.safe_load(result.stdout)
    assert set(printed) == set(OPTIONS)  # every option, by its current name
    expected = read_config_file("paper")[0].replace(shrinkage=0.2)
    (tmp_path / "mine.yaml").write_text(result.stdout)
    assert read_config_file(tmp_path / "mine.yaml")[0] == expected
    again = run_cli("train", tmp_path, "-o", tmp_path / "m.padim", "--config", tmp_path / "mine.yaml", "--print-config")
    assert again.stdout == result.stdout
    assert PadimConfig.from_mapping(printed) == expected
