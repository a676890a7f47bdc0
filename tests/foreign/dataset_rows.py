"""The rows of a `speculators prepare-data` dataset in its own order (prepare-data shuffles; generate-offline-data
names each hidden-states file hs_<i> after the row index i of this dataset). Runs in the speculators environment.

    python dataset_rows.py DATASET_DIR OUT.json      OUT: [{"input_ids": [...], "loss_mask": [...]}, ...]
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    from datasets import load_from_disk

    data = load_from_disk(argv[1]).with_format(None)
    rows = [{"input_ids": list(r["input_ids"]), "loss_mask": [int(m) for m in r["loss_mask"]]} for r in data]
    with open(argv[2], "w") as f:
        json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
