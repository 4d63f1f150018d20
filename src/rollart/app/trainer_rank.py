"""``python -m rollart.app.trainer_rank``: one trainer rank (1..N-1) of ``trainer.world_size``
(:mod:`rollart.engines.trainer_ranks`). Rank 0, the trainer on the bus, starts these on its
own host; on other hosts ``python -m rollart.node --config C --roles trainer --rank R``
starts one (:func:`main` with the config's ``trainer.master``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rollart.app.trainer_rank",
                                description="One trainer rank (1..world_size-1): joins rank 0 "
                                            "and computes its share of every step.")
    p.add_argument("--rank", type=int, required=True, help="this rank (1..world_size-1)")
    p.add_argument("--master", required=True, metavar="HOST:PORT", help="rank 0's rendezvous")
    p.add_argument("--model-dir", default=None, help="this host's model folder (default: rank 0's)")
    p.add_argument("--parent", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--log-level", default="INFO")
    return p


def run_rank(rank: int, master: str, *, model_dir: str | None = None, parent: int | None = None) -> int:
    """Serve as trainer rank ``rank`` of the group at ``master``; the exit status."""
    from rollart.engines.rank_launch import serve_rank  # optional dependency: torch

    try:
        return serve_rank(rank, master, model_dir=model_dir, parent=parent)
    except ValueError as e:
        print(f"rollart trainer rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # one line, and the status
        logging.getLogger(__name__).exception("trainer rank %d failed", rank)
        print(f"rollart trainer rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s rank{args.rank} %(name)s: %(message)s")
    return run_rank(args.rank, args.master, model_dir=args.model_dir, parent=args.parent)


if __name__ == "__main__":
    raise SystemExit(main())
