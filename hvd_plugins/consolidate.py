"""Make a checkpoint saved in parts (``shard_checkpoint="parts"``) whole: one file any Trainer can load.

    python -m hvd_plugins.consolidate last.ckpt                # writes last.full.ckpt
    python -m hvd_plugins.consolidate last.ckpt -o whole.ckpt

Reads the checkpoint and every part file beside it (``last.ckpt.optimizer-part-<rank>-of-<workers>``),
joins each optimizer's slices into the state of the whole optimizer, and writes a checkpoint that a
single process, or a job of any number of workers, sharded or not, resumes from. The checkpoint and
the parts are read memory-mapped, and each parameter's state is joined on its own into a scratch file
beside the output, mapped too: the process never holds the optimizer state in its own memory, whole
or in parts, only in files the kernel pages in and out as the output is written.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from hvd_plugins.core.sync.parts import Allocate, consolidate_checkpoint


def in_files(folder: Path) -> Allocate:
    """Tensors each mapped from a file of its own under ``folder`` (shared: what is written goes to the file)."""
    made = itertools.count()

    def allocate(count: int, dtype: torch.dtype) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=dtype)
        return torch.from_file(str(folder / f"{next(made)}"), shared=True, size=count, dtype=dtype)

    return allocate


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a checkpoint saved with shard_checkpoint='parts'")
    parser.add_argument("-o", "--output", type=Path, help="the whole checkpoint (default: <name>.full.ckpt)")
    args = parser.parse_args(argv)
    output = args.output or args.checkpoint.with_name(f"{args.checkpoint.stem}.full{args.checkpoint.suffix or '.ckpt'}")
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.scratch-") as scratch:
        try:
            checkpoint = consolidate_checkpoint(args.checkpoint, in_files(Path(scratch)))
        except (ValueError, FileNotFoundError) as error:
            print(f"hvd_plugins.consolidate: {error}", file=sys.stderr)
            return 2
        written = output.with_name(f".{output.name}.partial")  # the input stays mapped while this is written
        torch.save(checkpoint, written)
        os.replace(written, output)
    print(f"wrote {output}: {len(checkpoint['optimizer_states'])} optimizer state(s) made whole")
    return 0


if __name__ == "__main__":
    sys.exit(main())
