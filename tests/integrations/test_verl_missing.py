"""Without verl: megacritic imports and runs without it, and the adapter says how to install it."""

import importlib.util
import subprocess
import sys

import pytest


def test_megacritic_never_imports_verl():
    code = "import sys, megacritic, megacritic.cli; print('verl' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None, reason="verl is installed")
def test_adapter_without_verl_names_the_fix():
    from megacritic.integrations.verl import config_from_verl, critic_worker_cls
    with pytest.raises(ImportError, match=r"pip install 'verl==0\.9\.1'"):
        critic_worker_cls()
    # The config mapping itself needs no verl.
    assert "ppo_mini_batch_size=8" in config_from_verl({"ppo_mini_batch_size": 4, "rollout_n": 2})


def test_docs_list_every_verl_critic_setting():
    """docs/verl.md's table has a row for every rule of the mapping, in its order."""
    import os
    from megacritic.integrations.verl.config import _RULES
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "verl.md")).read()
    rows = [line.split("|")[1].strip().strip("`") for line in doc.splitlines() if line.startswith("| `")]
    assert rows == [pattern for pattern, _ in _RULES]
