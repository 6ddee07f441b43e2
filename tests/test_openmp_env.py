"""blendkv.openmp_env: the OpenMP wait setting `import blendkv` makes before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

from blendkv.openmp_env import SPIN_COUNT, set_openmp_defaults


def test_sets_a_short_spin_when_the_user_chose_nothing():
    env = {"PATH": "/bin"}
    assert set_openmp_defaults(env)
    assert env["GOMP_SPINCOUNT"] == SPIN_COUNT
    assert int(SPIN_COUNT) < 300_000  # libgomp's own default, the one that collapses


def test_leaves_the_users_choice_alone():
    for key, value in (("GOMP_SPINCOUNT", "300000"), ("OMP_WAIT_POLICY", "PASSIVE")):
        env = {key: value}
        assert not set_openmp_defaults(env)
        assert env == {key: value}


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    return {**env, **extra}


def test_import_blendkv_sets_it_before_torch_is_loaded():
    """The variable is only read when torch loads libgomp: importing blendkv must set it and
    must not import torch itself."""
    code = (
        "import os, sys, blendkv; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_child_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [SPIN_COUNT, "False"]
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_child_env(OMP_WAIT_POLICY="ACTIVE"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["None", "False"]
