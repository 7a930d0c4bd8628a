"""``import capsule`` loads only the errors; Session, ControlLoop and the tokenizers' campaign
come on first use (issue 19: the restore path pays only for what it needs)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
import capsule, capsule.tokenize
before = sorted(m for m in sys.modules if m.startswith(("capsule", "torch", "numpy")))
from capsule import Session, ControlLoop, UnsafeStore
print(json.dumps({"before": before, "session": Session.__module__,
                  "loop": ControlLoop.__module__, "unsafe": UnsafeStore.__module__,
                  "dir": "Session" in dir(capsule)}))
"""


def test_import_capsule_loads_no_torch_and_no_session():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(m.startswith(("torch", "numpy")) for m in got["before"]), got["before"]
    assert "capsule.session" not in got["before"] and "capsule.control" not in got["before"]
    assert "capsule.tokenize.differential" not in got["before"]
    assert (got["session"], got["loop"], got["unsafe"]) == ("capsule.session", "capsule.control",
                                                           "capsule.store.errors")
    assert got["dir"]


def test_unknown_names_raise_attribute_error():
    import capsule
    import capsule.tokenize
    with pytest.raises(AttributeError, match="no attribute 'Sesion'"):
        capsule.Sesion  # noqa: B018
    with pytest.raises(AttributeError):
        capsule.tokenize.run_diff  # noqa: B018
    from capsule.tokenize import run_differential
    assert callable(run_differential) and capsule.Session.__name__ == "Session"


GC_PROBE = r"""
import gc, json, sys
import capsule
sys.modules["capsule.control"] = None      # makes `from capsule import ControlLoop` fail
states = []
for enabled in (True, False):
    (gc.enable if enabled else gc.disable)()
    try:
        capsule.ControlLoop
    except ImportError:
        pass
    states.append(gc.isenabled())
gc.enable()
from capsule import Session
states.append(gc.isenabled())
print(json.dumps(states))
"""


def test_lazy_imports_give_the_callers_gc_state_back():
    """The lazy import pauses the cyclic GC (a cold restore's imports) and restores it as found,
    on a failed import too."""
    out = subprocess.run([sys.executable, "-c", GC_PROBE], capture_output=True, text=True, timeout=300,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, False, True]


def test_opening_an_existing_store_imports_no_sqlite_utils(tmp_path):
    """sqlite-utils (click, pluggy, dateutil: ~50 ms) is for creating a store, not for a restore."""
    make = ("import sys; from capsule import Session\n"
            "Session.open(sys.argv[1], model='builtin:tiny', device='cpu').close()\n"
            "print('sqlite_utils' in sys.modules)")
    probe = make.replace("print(", "import capsule.store; print(")
    first = subprocess.run([sys.executable, "-c", make, str(tmp_path / "s")], capture_output=True, text=True,
                           timeout=300, check=True)
    again = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "s")], capture_output=True, text=True,
                           timeout=300, check=True)
    assert first.stdout.split()[-1] == "True"      # creating the store used it
    assert again.stdout.split()[-1] == "False"     # reopening it did not
