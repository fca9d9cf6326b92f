"""Start N local ranks through PyTorch's elastic launcher (`torch.distributed.run`).

`fivefold train --nproc N` validates the config and prepares the data once in the launching
process, then hands the same command line (without `--nproc`) to torch.distributed.run, which
starts N workers running `python -m fivefold train ...` with RANK / WORLD_SIZE / LOCAL_RANK
set. Across nodes, call `torchrun` yourself with the same module and arguments; the workers
cannot tell the difference.

`--max-restarts N` is the elastic agent's: when a worker dies (any exit status but 0, SIGKILL
included), the agent stops the others and starts the whole group again, up to N times. Each
new worker runs the same command, which resumes from RUN_DIR's latest complete checkpoint
(fivefold.train.trainer), so the job finishes by itself as if uninterrupted. The restarted
workers get a fresh c10d store: with the agent's shared store (torch's default) a restarted
rank can read its peers' addresses from the failed attempt and fail to connect (pytorch
issue 135712, still so with gloo in torch 2.13), so `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`
is set for the agent; with `torchrun` set it yourself.

Ctrl-C or SIGTERM to the launcher: the agent passes the signal on to every worker (each in a
session of its own, so a terminal's Ctrl-C reaches the launcher alone) and waits up to
SHUTDOWN_S for them; they save a checkpoint at the next step boundary and end
(fivefold.train.interrupt), and the launcher exits with 128 + the signal, adding nothing to
rank 0's line: the agent's notes on passing the signal are filtered out. A second Ctrl-C makes
the agent send SIGTERM, which ends the workers at once. Workers that end by an interrupt of
their own (a signal sent to ranks, not to the launcher) exit 130 or 143, which the launcher
returns as it is.
"""

from __future__ import annotations

import logging
import os

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


SHUTDOWN_S = 600  # the agent's wait for interrupted workers' checkpoints before SIGKILL
INTERRUPTED = {130, 143, -2, -15}  # a worker's exit by an interrupt, or by the agent's SIGTERM
AGENT_NOTES = ("Received %s death signal", "Sending process %s closing signal")


def _without_signal_notes(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(AGENT_NOTES)


def launch_local(nproc: int, fivefold_args: list[str], max_restarts: int = 0) -> int:
    """Run `fivefold <fivefold_args>` on `nproc` local ranks, restarting the group up to
    `max_restarts` times when a rank fails; return the exit status."""
    if max_restarts:
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see above
    args = parse_args(["--standalone", f"--nproc-per-node={nproc}",
                       f"--max-restarts={max_restarts}", f"--shutdown-timeout={SHUTDOWN_S}",
                       "--module", "fivefold", *fivefold_args])
    for name in ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_without_signal_notes)
    try:
        run(args)
    except SignalException as err:  # the workers have saved and ended (fivefold.train.interrupt)
        return 128 + err.sigval
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes <= INTERRUPTED:  # interrupted ranks: rank 0 has said so
            return 143 if codes & {143, -15} else 130
        failures = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in err.failures.items())
        print(f"fivefold: {failures} failed; see the rank's output above", flush=True)
        return 1
    return 0
