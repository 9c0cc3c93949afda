import warnings

import pytest

from deltafuse.backends import REGISTRY
from deltafuse.backends.settings import forceable_backends, load_settings, resolve
from deltafuse.config import Settings, SettingsError, env_switch


def test_defaults_all_on():
    assert load_settings({}) == Settings(patch=True, gdn=True, fused_ops=True, moe=True, backend="auto")


@pytest.mark.parametrize("word,value", [("1", True), ("TRUE", True), ("Yes", True), ("on", True),
                                        ("0", False), ("false", False), ("NO", False), ("Off", False)])
def test_switch_words(word, value):
    s = load_settings({"DELTAFUSE_GDN": word, "DELTAFUSE_MOE": word})
    assert s.gdn is value and s.moe is value and s.patch is True


@pytest.mark.parametrize("var", ["DELTAFUSE_PATCH", "DELTAFUSE_GDN", "DELTAFUSE_FUSED_OPS", "DELTAFUSE_MOE",
                                 "TWINKLE_NPU_PATCH", "TWINKLE_NPU_FLA"])
def test_bad_switch_value_names_variable_and_allowed(var):
    with pytest.raises(SettingsError) as err:
        load_settings({var: "maybe"})
    msg = str(err.value)
    assert var in msg and "'maybe'" in msg and "on" in msg and "off" in msg


def test_backend_values():
    assert load_settings({"DELTAFUSE_BACKEND": "Triton"}).backend == "triton"
    assert load_settings({"DELTAFUSE_BACKEND": " "}).backend == "auto"
    with pytest.raises(SettingsError, match="DELTAFUSE_BACKEND='cuda' is not a backend; allowed: auto, triton, "
                                            "fla, npu, flash_qla, torch"):
        load_settings({"DELTAFUSE_BACKEND": "cuda"})


def test_forceable_backends_are_the_registered_names():
    registered = {c.name for op in REGISTRY.ops for c in REGISTRY.candidates(op)}
    names = forceable_backends()
    assert names[0] == "auto" and set(names[1:]) == registered and len(names) == len(set(names))
    assert {"triton", "fla", "npu", "torch"} <= registered
    # every registered name can be forced through the environment (npu could not be before)
    for name in registered:
        assert load_settings({"DELTAFUSE_BACKEND": name.upper()}).backend == name


@pytest.mark.parametrize("value", [3, 1.5, ["torch"], b"torch", True])
def test_backend_argument_of_the_wrong_type(value):
    with pytest.raises(SettingsError) as err:
        resolve(load_settings({}), backend=value)
    msg = str(err.value)
    assert f"backend={value!r}" in msg and type(value).__name__ in msg and "auto, triton, fla, npu, flash_qla, torch" in msg


@pytest.mark.parametrize("word,value", [("1", True), ("TRUE", True), ("Yes", True), ("on", True), ("0", False),
                                        ("false", False), ("NO", False), ("Off", False), ("", False)])
def test_validate_switch_words(word, value, monkeypatch):
    assert load_settings({"DELTAFUSE_VALIDATE": word}).validate is value
    monkeypatch.setenv("DELTAFUSE_VALIDATE", word)
    assert env_switch("DELTAFUSE_VALIDATE") is value


@pytest.mark.parametrize("word", ["garbage", "2", "enabled", "y"])
def test_validate_bad_value_is_an_error(word, monkeypatch):
    with pytest.raises(SettingsError, match=rf"DELTAFUSE_VALIDATE='{word}' is not a switch value"):
        load_settings({"DELTAFUSE_VALIDATE": word})
    monkeypatch.setenv("DELTAFUSE_VALIDATE", word)
    with pytest.raises(SettingsError, match=rf"DELTAFUSE_VALIDATE='{word}'.*allowed \(any case\): 1/true/yes/on"):
        env_switch("DELTAFUSE_VALIDATE")


def test_validate_unset_is_off(monkeypatch):
    monkeypatch.delenv("DELTAFUSE_VALIDATE", raising=False)
    assert env_switch("DELTAFUSE_VALIDATE") is False and load_settings({}).validate is False


@pytest.mark.parametrize("alias,field", [("TWINKLE_NPU_PATCH", "patch"), ("TWINKLE_NPU_FUSED_OPS", "fused_ops"),
                                         ("TWINKLE_NPU_MOE_PATCH", "moe"), ("TWINKLE_NPU_FLA", "gdn")])
def test_aliases(alias, field):
    assert getattr(load_settings({alias: "0"}), field) is False


def test_alias_disagreement_ours_wins_with_warning():
    with pytest.warns(UserWarning, match="DELTAFUSE_MOE.*TWINKLE_NPU_MOE_PATCH.*disagree"):
        s = load_settings({"DELTAFUSE_MOE": "on", "TWINKLE_NPU_MOE_PATCH": "off"})
    assert s.moe is True


def test_alias_agreement_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_settings({"DELTAFUSE_GDN": "off", "TWINKLE_NPU_FLA": "0"}).gdn is False


def test_resolve_overrides_and_rejects():
    base = load_settings({"DELTAFUSE_GDN": "0"})
    assert resolve(base, gdn=True, moe=None).gdn is True
    assert resolve(base, gdn=None).gdn is False
    assert resolve(base, backend="torch").backend == "torch"
    with pytest.raises(SettingsError, match="gdn='yes'"):
        resolve(base, gdn="yes")
    with pytest.raises(SettingsError, match="backend='gpu'"):
        resolve(base, backend="gpu")


def test_a_candidate_registered_from_an_op_folder_makes_its_name_forceable():
    """What an op's candidates.py does for a new backend is all it takes: the name can be forced at once."""
    from deltafuse.backends import Candidate, current_backend

    with pytest.raises(SettingsError, match="DELTAFUSE_BACKEND='xpu' is not a backend"):
        load_settings({"DELTAFUSE_BACKEND": "xpu"})
    REGISTRY.register("swiglu", Candidate("xpu", lambda: None, supports=lambda call: "needs an xpu device"),
                      before="torch")
    try:
        assert "xpu" in forceable_backends()
        assert load_settings({"DELTAFUSE_BACKEND": "XPU"}).backend == "xpu"
        assert resolve(load_settings({}), backend="xpu").backend == "xpu"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DELTAFUSE_BACKEND", "xpu")
            assert current_backend() == "xpu"
    finally:
        REGISTRY.unregister("swiglu", "xpu")
    with pytest.raises(SettingsError, match="DELTAFUSE_BACKEND='xpu' is not a backend"):
        load_settings({"DELTAFUSE_BACKEND": "xpu"})
