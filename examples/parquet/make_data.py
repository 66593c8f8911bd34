"""Write scikit-learn's handwritten digits (bundled: no download) as a Parquet table for examples/parquet/spec.yaml.

    python examples/parquet/make_data.py [OUT_DIR]     # default: examples/parquet/data

One file, ``OUT_DIR/digits.parquet``: 1797 rows in row groups of 128 (polytrain reads a row group at a time and
shuffles row groups, then rows within a window of them), columns ``pixels`` (64 floats in [0, 1], a fixed-size
array per row) and ``label`` (0-9). A directory or a glob of such files works the same way (``data.path``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from sklearn.datasets import load_digits


def main(out: Path) -> None:
    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    table = pa.table({
        "pixels": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1]),
        "label": bunch.target.astype(np.int64),
    })
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "digits.parquet", row_group_size=128)
    groups = pq.ParquetFile(out / "digits.parquet").metadata.num_row_groups
    print(f"wrote {out / 'digits.parquet'}: {table.num_rows} rows in {groups} row groups")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "data")
