"""Write docs/events.md, the SQL user's reference of every event kind, from engine/catalog.py.

    .venv/bin/python docs/generate_events.py

tests/engine/test_catalog.py fails when the checked-in file is not what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from engine.catalog import reference  # noqa: E402

if __name__ == "__main__":
    (HERE / "events.md").write_text(reference())
    print(f"wrote {HERE / 'events.md'}")
