"""NEURON_EAGER=adaptive turns the library on at ``import torch`` for an unmodified script."""

import subprocess
import sys
import textwrap

import pytest
from _oracle import program_env

import adaptive_eager as ae
from adaptive_eager.config import ConfigError, load_options, switch_value

UNMODIFIED_SCRIPT = textwrap.dedent(
    """
    import torch
    x = torch.ones(4)
    y = (x * 3 + 1).sum()
    import adaptive_eager  # only to look at what happened; the script itself is plain torch
    print("lazy", adaptive_eager.is_lazy(y), "enabled", adaptive_eager.is_enabled())
    print("value", y.item())
    print("recorded", adaptive_eager.metrics()["ops_recorded"])
    """
)


def _run(env_value):
    env = program_env()
    if env_value is not None:
        env["NEURON_EAGER"] = env_value
    return subprocess.run([sys.executable, "-c", UNMODIFIED_SCRIPT], env=env, capture_output=True, text=True, timeout=120)


def test_env_var_turns_it_on_with_no_code_change():
    out = _run("adaptive")
    assert out.returncode == 0, out.stderr
    assert "lazy True enabled True" in out.stdout
    assert "value 16.0" in out.stdout
    assert "recorded 4" in out.stdout  # ones, mul, add, sum


@pytest.mark.parametrize("value", [None, "eager"])
def test_env_var_off(value):
    out = _run(value)
    assert out.returncode == 0, out.stderr
    assert "lazy False enabled False" in out.stdout
    assert "recorded 0" in out.stdout


def test_bad_switch_value_warns_and_stays_off():
    out = _run("adaptiv")
    assert out.returncode == 0, out.stderr
    assert "lazy False" in out.stdout
    assert "expected 'adaptive'" in out.stderr and "did you mean 'adaptive'?" in out.stderr


def test_a_misspelt_choice_names_the_closest_value_and_case_is_ignored_everywhere():
    """`NEURON_EAGER=Adaptive` was taken while `adaptiv` named no value: every choice setting (and the
    switch) ignores case alike, and a value that is no choice names the closest one."""
    assert switch_value({"NEURON_EAGER": "Adaptive"}) == "adaptive"
    assert load_options({"NEURON_EAGER_BACKEND": "Replay", "NEURON_EAGER_DEVICE": "cpu"}).backend == "replay"
    with pytest.raises(ConfigError, match="did you mean 'inductor'"):
        load_options({"NEURON_EAGER_BACKEND": "inducter", "NEURON_EAGER_DEVICE": "cpu"})
    with pytest.raises(ConfigError, match="did you mean 'eager'"):
        switch_value({"NEURON_EAGER": "eagr"})
    # named as spelled, matched in any case: `Adaptiv` is `adaptiv`, one letter from `adaptive`
    with pytest.raises(ConfigError, match=r"NEURON_EAGER='Adaptiv': expected .*did you mean 'adaptive'\?"):
        switch_value({"NEURON_EAGER": "Adaptiv"})


def test_env_settings_are_parsed_in_one_place_with_clear_errors():
    opts = load_options({"NEURON_EAGER_WINDOW": "7", "NEURON_EAGER_DEVICE": "cpu"})
    assert opts.window == 7 and opts.device == "cpu"
    with pytest.raises(ConfigError, match="NEURON_EAGER_WINDOW"):
        load_options({"NEURON_EAGER_WINDOW": "lots"})
    with pytest.warns(UserWarning, match="did you mean NEURON_EAGER_WINDOW"):
        load_options({"NEURON_EAGER_WINDOWS": "7"})
    assert switch_value({"NEURON_EAGER": "adaptive"}) == "adaptive"
    assert switch_value({}) == "eager"


def test_compile_after_exit_s_is_seconds_and_0_turns_it_off():
    env = {"NEURON_EAGER_DEVICE": "cpu"}
    assert load_options(env).compile_after_exit_s == 300
    assert load_options({**env, "NEURON_EAGER_COMPILE_AFTER_EXIT_S": "0"}).compile_after_exit_s == 0
    assert load_options(env, compile_after_exit_s=12.5).compile_after_exit_s == 12.5
    for bad in ("-1", "soon"):
        with pytest.raises(ConfigError, match="NEURON_EAGER_COMPILE_AFTER_EXIT_S=.*expected a number >= 0"):
            load_options({**env, "NEURON_EAGER_COMPILE_AFTER_EXIT_S": bad})
    with pytest.raises(ConfigError, match="compile_after_exit_s=-2"):
        load_options(env, compile_after_exit_s=-2)


def test_keyword_overrides_environment():
    opts = load_options({"NEURON_EAGER_WINDOW": "7"}, window=9)
    assert opts.window == 9
    with ae.adaptive_eager(window=3):
        assert ae._state.current_state().options.window == 3


def test_config_error_is_an_adaptive_eager_error():
    """One root for the library's own errors; a bad setting is still a ValueError."""
    with pytest.raises(ae.AdaptiveEagerError, match="NEURON_EAGER_WINDOW") as err:
        load_options({"NEURON_EAGER_WINDOW": "lots"})
    assert isinstance(err.value, ae.ConfigError) and isinstance(err.value, ValueError)
