"""toolkit.config: typed recipes, overrides, and errors that name the field."""
from __future__ import annotations

from dataclasses import dataclass, field
import typing
from typing import Literal, Union

import pytest

from decode.common.errors import UserError
from toolkit.config import apply_overrides, dump_yaml, from_dict, load_recipe, parse_override, to_dict


@dataclass(frozen=True, kw_only=True)
class FileSrc:
    type: Literal["file"] = "file"
    path: str
    limit: int | None = None


@dataclass(frozen=True, kw_only=True)
class HubSrc:
    type: Literal["hub"] = "hub"
    name: str
    split: str = "train"


@dataclass(frozen=True, kw_only=True)
class Opt:
    lr: float = 1e-3
    steps: int = 10
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])

    def __post_init__(self):
        if self.steps < 1:
            raise UserError(f"opt.steps must be >= 1, got {self.steps}")


@dataclass(frozen=True, kw_only=True)
class Toy:
    name: str
    mode: Literal["fast", "slow"] = "fast"
    debug: bool = False
    opt: Opt = field(default_factory=Opt)
    sources: list[Union[FileSrc, HubSrc]] = field(default_factory=lambda: [FileSrc(path="a.jsonl")])
    tags: dict[str, int] = field(default_factory=dict)
    out: str | None = None


def test_from_dict_fills_defaults_and_builds_nested_and_union_members():
    t = from_dict(Toy, {"name": "x", "opt": {"lr": 1}, "sources": [{"type": "hub", "name": "org/ds"},
                                                                  {"type": "file", "path": "p"}]})
    assert t.opt == Opt(lr=1.0)
    assert isinstance(t.opt.lr, float)
    assert t.sources == [HubSrc(name="org/ds"), FileSrc(path="p")]
    assert from_dict(Toy, to_dict(t)) == t  # round trip


@pytest.mark.parametrize("data, needle", [
    ({"name": "x", "opt": {"stesp": 3}}, "'opt.stesp'"),
    ({"name": "x", "nme": "y"}, "'nme'"),
    ({"name": "x", "opt": {"steps": "3"}}, "'opt.steps' must be an integer"),
    ({"name": "x", "opt": {"steps": True}}, "'opt.steps' must be an integer"),
    ({"name": "x", "debug": "yes"}, "'debug' must be a boolean"),
    ({"name": "x", "mode": "quick"}, "'mode' must be one of 'fast', 'slow'"),
    ({"name": 5}, "'name' must be a string"),
    ({}, "'name' is required"),
    ({"name": "x", "sources": [{"type": "fil", "path": "p"}]}, "'sources[0].type' must be one of 'file', 'hub'"),
    ({"name": "x", "sources": [{"type": "hub"}]}, "'sources[0].name' is required"),
    ({"name": "x", "sources": [{"type": "hub", "name": "n", "path": "p"}]}, "'sources[0].path'"),
    ({"name": "x", "opt": {"betas": 0.9}}, "'opt.betas' must be a list"),
    ({"name": "x", "tags": {"a": "b"}}, "'tags.a' must be an integer"),
    ({"name": "x", "opt": {"steps": 0}}, "opt.steps must be >= 1"),
])
def test_validation_errors_name_the_field(data, needle):
    with pytest.raises(UserError) as e:
        from_dict(Toy, data)
    assert needle in str(e.value)


def test_unknown_key_suggests_the_close_match():
    with pytest.raises(UserError, match="did you mean 'steps'"):
        from_dict(Toy, {"name": "x", "opt": {"stesp": 3}})


def test_overrides_dotted_list_index_yaml_values_and_literal_strings():
    base = from_dict(Toy, {"name": "x"})
    t = apply_overrides(Toy, base, ["opt.steps=5", "opt.betas=[0.5, 0.6]", "sources.0.limit=7",
                                    "name=123", "out=null", "debug=true", "tags.k=2", "sources[0].path=b.jsonl"])
    assert t.opt.steps == 5 and t.opt.betas == [0.5, 0.6]
    assert t.sources[0] == FileSrc(path="b.jsonl", limit=7)
    assert t.name == "123"  # a str field keeps the literal text
    assert t.out is None and t.debug is True and t.tags == {"k": 2}
    assert base.opt.steps == 10  # the input is not mutated
    # replacing a whole union list by YAML, then indexing into the new member
    t2 = apply_overrides(Toy, base, ["sources=[{type: hub, name: org/x}]", "sources.0.split=test"])
    assert t2.sources == [HubSrc(name="org/x", split="test")]


@pytest.mark.parametrize("item, needle", [
    ("opt.stpes=3", "unknown field 'opt.stpes'; did you mean 'steps'"),
    ("sources.3.path=x", "is a list of 1 item"),
    ("opt.steps=abc", "'opt.steps' must be an integer"),
    ("noequals", "must look like key=value"),
    ("debug.x=1", "has no field 'x'"),
    ("sources.0.name=x", "unknown field 'sources[0].name'"),  # FileSrc has no 'name' (HubSrc does)
])
def test_override_errors(item, needle):
    with pytest.raises(UserError) as e:
        apply_overrides(Toy, from_dict(Toy, {"name": "x"}), [item])
    assert needle in str(e.value)


def test_parse_override_splits_keys_and_parses_values():
    assert parse_override("a.b.0.c=[1, 2]") == (["a", "b", 0, "c"], [1, 2], "[1, 2]")
    assert parse_override("x=") == (["x"], "", "")


def test_load_recipe_from_yaml_with_overrides_and_required_field_from_override(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("opt:\n  steps: 3\nsources:\n  - type: hub\n    name: org/ds\n")
    t = load_recipe(Toy, p, ["name=from-cli", "sources.0.split=validation"])
    assert t.name == "from-cli" and t.opt.steps == 3 and t.sources == [HubSrc(name="org/ds", split="validation")]
    assert load_recipe(Toy, None, ["name=n"]) == Toy(name="n")
    assert from_dict(Toy, __import__("yaml").safe_load(dump_yaml(t))) == t


def test_load_recipe_file_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_recipe(Toy, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_recipe(Toy, bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(UserError, match="top level must be a mapping"):
        load_recipe(Toy, lst)
    typo = tmp_path / "typo.yaml"
    typo.write_text("name: x\nopt:\n  lr: fast\n")
    with pytest.raises(UserError, match=r"recipe .*typo.yaml: field 'opt.lr' must be a number"):
        load_recipe(Toy, typo)


def test_scientific_notation_is_a_number_although_yaml_1_1_reads_it_as_text(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("name: n\nopt:\n  lr: 1e-3\n  betas: [9e-1, 2E-2]\n")
    t = load_recipe(Toy, p, ["opt.steps=4"])
    assert t.opt.lr == pytest.approx(1e-3) and t.opt.betas == [pytest.approx(0.9), pytest.approx(0.02)]
    assert load_recipe(Toy, p, ["opt.lr=5e-4"]).opt.lr == pytest.approx(5e-4)
    with pytest.raises(UserError, match="opt.lr"):
        load_recipe(Toy, p, ["opt.lr=fast"])
    assert load_recipe(Toy, p, ["name=1e-3"]).name == "1e-3"  # a str field keeps the text


def test_device_and_dtype_field_helpers_match_decode_device():
    import typing

    from decode.common.device import DEVICES, DTYPES
    from toolkit.config import DEVICE_CHOICES, DTypeName, check_device_spec

    assert typing.get_args(DTypeName) == ("auto", *DTYPES) and DEVICE_CHOICES == DEVICES
    for ok in ("auto", "cpu", "cuda", "cuda:0", "CUDA:3", " cpu "):
        check_device_spec(ok, "device")
    for bad in ("gpu", "cuda:", "cuda:x", "cpu:0", "", 3):
        with pytest.raises(UserError, match=r"^train.device must be auto\|cpu\|cuda\[:N\]"):
            check_device_spec(bad, "train.device")


@dataclass(frozen=True, kw_only=True)
class Moved:
    name: str = "n"
    opt: Opt = field(default_factory=Opt)
    renamed_fields: typing.ClassVar[dict[str, str]] = {"precision": "opt.dtype"}


def test_a_renamed_field_names_its_new_place_in_recipes_and_overrides():
    with pytest.raises(UserError, match="field 'precision' is now 'opt.dtype'"):
        from_dict(Moved, {"precision": "bf16"})
    with pytest.raises(UserError, match="override 'precision=bf16': field 'precision' is now 'opt.dtype'"):
        apply_overrides(Moved, Moved(), ["precision=bf16"])
    assert to_dict(Moved()) == {"name": "n", "opt": to_dict(Opt())}  # a class attribute, not a field
