"""Settings: the reference file, discovery order and validation errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import tomllib

from rankscope.config import CONFIG_DIR
from rankscope.tui.settings import (
    Settings,
    SettingsError,
    deterministic_settings,
    find_config,
    load_settings,
    settings_from_mapping,
)


def _all_fields(obj: object, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_all_fields(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def test_reference_file_lists_every_field_with_its_default() -> None:
    data = tomllib.loads((CONFIG_DIR / "default.toml").read_text())
    flat = {f"{sec}.{k}": v for sec, table in data.items() for k, v in table.items()}
    defaults = _all_fields(Settings())
    assert set(flat) == set(defaults)
    for key, value in defaults.items():
        # A TOML array is read into a tuple field.
        assert (tuple(flat[key]) if isinstance(value, tuple) else flat[key]) == value, key
    assert settings_from_mapping(data) == Settings()


def test_every_field_has_a_docstring() -> None:
    import ast
    import inspect

    from rankscope.tui import settings as mod

    tree = ast.parse(inspect.getsource(mod))
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("s")):
        if cls.name == "SettingsError":
            continue
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                has_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                assert has_doc, f"{cls.name}.{node.target.id} has no docstring"  # type: ignore[attr-defined]


def test_discovery_order(tmp_path: Path) -> None:
    flag = tmp_path / "flag.toml"
    envf = tmp_path / "env.toml"
    cwd = tmp_path / "cwd"
    xdg = tmp_path / "xdg"
    cwd.mkdir()
    (xdg / "rankscope").mkdir(parents=True)
    for p, metric in ((flag, "wait"), (envf, "power"), (cwd / "rankscope.toml", "input")):
        p.write_text(f'[view]\nmetric = "{metric}"\n')
    (xdg / "rankscope" / "config.toml").write_text('[view]\nmetric = "transfer"\n')
    env = {"RANKSCOPE_CONFIG": str(envf), "XDG_CONFIG_HOME": str(xdg)}
    assert load_settings(str(flag), env, cwd).view.metric == "wait"
    assert load_settings(None, env, cwd).view.metric == "power"
    env.pop("RANKSCOPE_CONFIG")
    assert load_settings(None, env, cwd).view.metric == "input"
    (cwd / "rankscope.toml").unlink()
    assert load_settings(None, env, cwd).view.metric == "transfer"
    (xdg / "rankscope" / "config.toml").unlink()
    assert find_config(None, env, cwd) is None
    assert load_settings(None, env, cwd) == Settings()


def test_missing_flag_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="--config"):
        find_config(str(tmp_path / "nope.toml"), {}, tmp_path)
    with pytest.raises(SettingsError, match="RANKSCOPE_CONFIG"):
        find_config(None, {"RANKSCOPE_CONFIG": str(tmp_path / "nope.toml")}, tmp_path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('[view]\nmetrc = "step"\n', "unknown key 'view.metrc'"),
        ('[veiw]\nmetric = "step"\n', "unknown key 'veiw'"),
        ("[view]\nwindow_steps = 'many'\n", "view.window_steps must be int, got str"),
        ('[view]\nmetric = "speed"\n', "view.metric 'speed' is not one of"),
        ("[refresh]\nsample_hz = 0\n", "refresh.sample_hz must be in"),
        ("[display]\nshow_clock = 1\n", "display.show_clock must be bool"),
        ("[view]\nwindow_steps = true\n", "view.window_steps must be int, got bool"),
        ("view = 3\n", r"\[view\] must be a table"),
        ("[view\n", "not valid TOML"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=match) as info:
        load_settings(str(path), {}, tmp_path)
    assert str(path) in str(info.value)


def test_int_accepted_for_float_and_deterministic_profile(tmp_path: Path) -> None:
    s = settings_from_mapping({"refresh": {"sample_hz": 2}})
    assert s.refresh.sample_hz == 2.0 and isinstance(s.refresh.sample_hz, float)
    quiet = deterministic_settings(tmp_path)
    assert not quiet.display.show_clock and not quiet.display.show_machine
    assert not quiet.display.animation
    assert quiet.state_dir() == tmp_path and quiet.state.persist
    assert not deterministic_settings().state.persist
