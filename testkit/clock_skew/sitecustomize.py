"""A host whose wall clock disagrees with the others': put this folder on PYTHONPATH and set
ROLLBOOK_TEST_CLOCK_SKEW_S, and every wall-clock reading of the process (time.time, time.time_ns,
datetime.now) is off by that many seconds. The monotonic clock is left alone: it has no epoch to
disagree about, and a host's monotonic clock is what a process may trust of its own."""

import datetime as _dt
import os
import time as _time

_SKEW = float(os.environ.get("ROLLBOOK_TEST_CLOCK_SKEW_S", "0") or 0)
if _SKEW:
    _real_time, _real_time_ns = _time.time, _time.time_ns
    _time.time = lambda: _real_time() + _SKEW
    _time.time_ns = lambda: _real_time_ns() + int(_SKEW * 1e9)

    class _Skewed(_dt.datetime):
        @classmethod
        def now(cls, tz=None):  # type: ignore[override]
            return _dt.datetime.fromtimestamp(_time.time(), tz)

        @classmethod
        def utcnow(cls):  # type: ignore[override]
            return _dt.datetime.fromtimestamp(_time.time(), _dt.UTC).replace(tzinfo=None)

    _dt.datetime = _Skewed  # type: ignore[misc]
