"""Start N local ranks through PyTorch's elastic launcher (`torch.distributed.run`).

`fivefold train --nproc N` validates the config and prepares the data once in the launching
process, then hands the same command line (without `--nproc`) to torch.distributed.run, which
starts N workers running `python -m fivefold train ...` with RANK / WORLD_SIZE / LOCAL_RANK
set. Across nodes, call `torchrun` yourself with the same module and arguments; the workers
cannot tell the difference.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launch_local(nproc: int, fivefold_args: list[str]) -> int:
    """Run `fivefold <fivefold_args>` on `nproc` local ranks; return the exit status."""
    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module", "fivefold",
                       *fivefold_args])
    try:
        run(args)
    except ChildFailedError as err:
        failures = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in err.failures.items())
        print(f"fivefold: {failures} failed; see the rank's output above", flush=True)
        return 1
    return 0
