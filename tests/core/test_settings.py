"""Typed settings (nexrl_core.Settings): one dataclass declares a component's keys with their types,
defaults, help and bounds; the Option table recipes are checked against is derived from it, and a
checked section becomes a typed, frozen object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import pytest

from nexrl_core import REQUIRED, ConfigError, InferenceClient, Option, Settings, component_options, setting
from nexrl_core.config.options import check_options, describe_type


@dataclass(frozen=True, kw_only=True)
class Adapter(Settings):
    rank: int = setting(16, "adapter rank", ge=1)
    modules: list[str] = setting(["q_proj"], "which linears")


@dataclass(frozen=True, kw_only=True)
class Server(Settings):
    model_path: str = setting(help="the model folder", path=True)
    port: int | None = setting(None, "its port (null: a free one)", ge=1, le=65535)
    dtype: Literal["auto", "float32", "bfloat16"] = setting("auto", "the weights' precision")
    mode: str = setting("fast", "how to run", choices=("fast", "exact"))
    env: dict[str, str] = setting({}, "environment of the process")
    adapter: Adapter = setting(Adapter, "the adapter")
    draft: Adapter | None = setting(None, "a second adapter, if any")


def test_the_fields_are_the_options_recipes_are_checked_against():
    options = Server.options()
    assert list(options) == ["model_path", "port", "dtype", "mode", "env", "adapter", "draft"]
    assert options["model_path"].default is REQUIRED and options["model_path"].path
    assert options["port"] == Option(None, int | None, "its port (null: a free one)", ge=1, le=65535)
    assert describe_type(options["dtype"]) == "one of 'auto', 'float32', 'bfloat16'"
    assert options["adapter"].default_value() == {"rank": 16, "modules": ["q_proj"]}
    assert options["draft"].default_value() is None and options["draft"].options == Adapter.options()
    problems = check_options({"model_path": "m", "port": 0, "mode": "fsat", "adapter": {"rank": 0}, "drfat": {}},
                             options, "service")
    assert problems == ["service.port: expected an integer >= 1 and <= 65535, got 0",
                        "service.mode: 'fsat' is not one of fast, exact; did you mean 'fast'?",
                        "service.adapter.rank: expected a positive integer, got 0",
                        "service.drfat: unknown key; did you mean 'service.draft'?"]


def test_a_section_becomes_a_typed_frozen_object_with_its_defaults():
    got = Server.of({"model_path": "m", "port": 8000, "adapter": {"rank": 4}, "draft": {"modules": ["k_proj"]}})
    assert got == Server(model_path="m", port=8000, adapter=Adapter(rank=4), draft=Adapter(modules=["k_proj"]))
    assert got.dtype == "auto" and got.env == {} and got.adapter.modules == ["q_proj"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.port = 1  # type: ignore[misc]
    default = Server.of({"model_path": "m"})
    assert default.adapter == Adapter() and default.draft is None
    assert default.to_dict()["adapter"] == {"rank": 16, "modules": ["q_proj"]}
    # each object has its own mutable defaults
    assert Server.of({"model_path": "m"}).adapter.modules is not default.adapter.modules


def test_a_bad_section_is_one_error_naming_every_key():
    with pytest.raises(ConfigError) as caught:
        Server.of({"port": "80", "dtype": "fp8"}, "service.inference_service")
    assert str(caught.value) == (
        "service.inference_service.port: expected an integer or null, got a string ('80'); "
        "service.inference_service.dtype: 'fp8' is not one of auto, float32, bfloat16; "
        "service.inference_service.model_path: required (the model folder)")
    assert Server.parse({"model_path": "m"}) == (Server(model_path="m"), [])
    assert Server.parse({"model_path": "m", "backend": "x"}, own=True)[1] == []


def test_own_reads_a_components_keys_of_a_section_that_holds_the_cores_too():
    section = {"backend": "mine", "model_tag": "default", "model_path": "m", "port": 9}
    assert Server.own(section) == Server(model_path="m", port=9)
    with pytest.raises(ConfigError, match="unknown key"):
        Server.of(section)


def test_a_components_settings_count_as_its_options_next_to_its_bases():
    class Base(InferenceClient):
        OPTIONS = {"timeout": Option(60.0, float, "seconds per request", gt=0)}

    class Backend(Base):
        SETTINGS = Server

        def complete(self, prompt, params):
            raise NotImplementedError

    assert list(component_options(Backend)) == ["timeout", *Server.options()]


def test_a_settings_class_must_be_a_dataclass():
    class Loose(Settings):
        port: int = 1

    with pytest.raises(TypeError, match=r"Loose: a Settings class must be a dataclass: @dataclass\(frozen=True"):
        Loose.options()
