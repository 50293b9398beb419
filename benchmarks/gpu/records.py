"""The GPU scripts' records: each one a JSON line on stdout (what the kit driver and the suite read) and, with $OUT
set (the device tool's folder that comes back), the list so far rewritten as one JSON file there."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable


def emitter(filename: str) -> Callable[[dict], None]:
    """emit(rec): prints rec and rewrites $OUT/filename with every record emitted so far."""
    records: list[dict] = []

    def emit(rec: dict) -> None:
        records.append(rec)
        print(json.dumps(rec), flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], filename).write_text(json.dumps(records, indent=1))

    return emit
