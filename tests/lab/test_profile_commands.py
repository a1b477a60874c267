"""`kvstreamd profile costs|tune-rate` on bad input: one line naming what is wrong, exit status 2,
before any text is prefilled (issue 49, item 7)."""
from __future__ import annotations

import pytest

from codec.tuning import registry
from kvstreamd import cli

GEMMA = registry.SHIPPED_DIR / "gemma3-270m.kvprofile"


def refusal(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    [line] = [ln for ln in err.splitlines() if ln.startswith("kvstreamd ")]  # (beside transformers' progress bar)
    return line


@pytest.mark.parametrize("command", ["costs", "tune-rate"])
def test_a_kind_of_text_not_tuned_on_or_a_model_not_known_is_one_line(capsys, command):
    err = refusal(capsys, ["profile", command, "--texts", "wikitext", "manual"])
    assert err.startswith(f"kvstreamd profile {command}: --texts manual: not a kind of text tuned on")
    err = refusal(capsys, ["profile", command, "--model", "no-such-model"])
    assert err.startswith(f"kvstreamd profile {command}: --model: unknown model 'no-such-model'")


@pytest.mark.system  # the real model is loaded before the profile is judged against it
@pytest.mark.parametrize("command", ["costs", "tune-rate"])
def test_a_profile_that_does_not_load_or_is_another_models_is_one_line(capsys, tmp_path, command, monkeypatch):
    from kvstreamd.lab import calibrate

    monkeypatch.setattr(calibrate, "tuning_cases", lambda *a, **k: pytest.fail("prefilled text"))
    bad = tmp_path / "bad.kvprofile"
    bad.write_bytes(b"not a profile")
    err = refusal(capsys, ["profile", command, "--profile", str(bad)])
    assert err.startswith(f"kvstreamd profile {command}: {bad}: not a readable profile file")
    err = refusal(capsys, ["profile", command, "--profile", str(GEMMA)])
    assert err.startswith(f"kvstreamd profile {command}: {GEMMA}: the profile of model 'gemma"), err
