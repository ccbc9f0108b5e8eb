"""A process whose subgroup build was given up on, exiting right after (test_exit_after_give_up)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from test_subgroup_late_build import OP, TOKEN, _late_second_build, _member, _two_members  # noqa: E402

from shoal.membership.transport import gloo_backend  # noqa: E402

if __name__ == "__main__":
    out = _two_members(TOKEN, _member, {"a": gloo_backend, "b": _late_second_build(OP + 1.0)})
    assert not out["a"][0][1] and not out["b"][0][1], out    # both gave up on the first step's subgroup
    print("exiting", flush=True)   # with B's abandoned constructor still running
