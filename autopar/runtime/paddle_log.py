"""Paddle's own C++ log lines kept to errors while autopar runs a program (stage: runtime).

Paddle logs through glog: "New Executor is Running", "pir interpreter is running by
multi-thread mode", tcp_store connection lines, "not support input out tensor", several per
rank and run. ``python -m autopar.launch`` keeps them out by starting every rank with
``GLOG_minloglevel=2``; glog reads that variable once, when Paddle's library is loaded, so a
process started any other way (a script calling :func:`autopar.simulate`, a job under
``python -m paddle.distributed.launch``) still prints them. Nothing in Paddle 3.3.1 sets the
level after import: ``paddle.set_flags`` knows only Paddle's own flags, ``core.init_gflags``
parses once at import (later calls return False and change nothing), ``core.set_vlog_level``
sets the verbose level only. What works is writing glog's ``FLAGS_minloglevel`` variable
itself, which Paddle's libraries export (``libpaddle.so``, and ``libphi_core.so`` with its own
copy); glog reads it at every log statement. :func:`quiet_paddle_logs` does that when an
Executor or a simulation starts, unless the user asked for Paddle's lines (``GLOG_v`` or
``GLOG_minloglevel`` in the environment; ``autopar.launch --verbose`` sets the latter to 0).
Lines logged before then — while the program is built — are not affected.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

ERRORS_ONLY = 2  # glog severities: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL
USER_SETTINGS = ("GLOG_v", "GLOG_minloglevel")
MIN_LOG_LEVEL = "_ZN3fLI17FLAGS_minloglevelE"  # glog's ``fLI::FLAGS_minloglevel`` (C++ mangled)


def quiet_paddle_logs() -> bool:
    """Raise glog's minimum level to errors in every Paddle library loaded in this process,
    unless the environment sets ``GLOG_v`` / ``GLOG_minloglevel``; returns whether a level was
    set (False also where the libraries do not export the variable)."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    changed = False
    for level in _level_variables():
        if level.value < ERRORS_ONLY:
            level.value = ERRORS_ONLY
            changed = True
    return changed


def _level_variables() -> list[ctypes.c_int]:
    """glog's ``FLAGS_minloglevel`` of each Paddle library already loaded (none loaded anew)."""
    import paddle
    from paddle.base import libpaddle

    found = []
    for path in (Path(libpaddle.__file__), Path(paddle.__file__).parent / "libs" / "libphi_core.so"):
        try:
            library = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            found.append(ctypes.c_int.in_dll(library, MIN_LOG_LEVEL))
        except (OSError, ValueError):  # not loaded, or glog's variable not exported by this build
            continue
    return found
