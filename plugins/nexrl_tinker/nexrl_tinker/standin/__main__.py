"""``python -m nexrl_tinker.standin --model NAME=HF_FOLDER``: serve a local stand-in of the Tinker API.

Then point the SDK or a recipe at it, e.g.::

    python -m nexrl_tinker.standin --model smol=/path/to/SmolLM2-135M-Instruct --port 8765 &
    export TINKER_BASE_URL=http://127.0.0.1:8765 TINKER_API_KEY=tml-local
    # recipe: service.train_service.base_model: smol

Any API key starting with ``tml-`` is accepted unless ``--api-key`` names the only one. State
(``tinker://`` checkpoints) lives in ``--state-dir`` (a temporary folder by default, removed at
exit). ``--fault PATH:NTH:ACTION[:COUNT]`` makes requests fail on purpose (ACTION: an HTTP status,
``hang`` or ``request_failed``), e.g. ``--fault forward_backward:3:500``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nexrl_tinker.standin", description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="[NAME=]HF_FOLDER",
                        help="a model to serve (a transformers causal-LM folder); NAME defaults to the folder name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    parser.add_argument("--state-dir", default=None, help="where tinker:// checkpoints are kept")
    parser.add_argument("--api-key", default=os.environ.get("TINKER_STANDIN_API_KEY"),
                        help="accept only this key (default: any key starting with tml-)")
    parser.add_argument("--try-again-polls", type=int, default=0,
                        help="answer the first N polls of every future 'try again' (exercises client polling)")
    parser.add_argument("--poll-wait", type=float, default=0.2, help="seconds a poll waits for a pending result")
    parser.add_argument("--fwdbwd-chunk-len", type=int, default=1024, help="datums per forward_backward request")
    parser.add_argument("--fault", action="append", default=[], metavar="PATH:NTH:ACTION[:COUNT]")
    parser.add_argument("--sample-batch-rows", type=int, default=64,
                        help="most samples decoded together (queued requests of one sampler join a batch)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch intra-op threads (default: half the cores; more threads than free cores "
                             "slow decoding down many times)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.sample_batch_rows < 1:
        parser.error(f"--sample-batch-rows must be >= 1, got {args.sample_batch_rows}")
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level=args.log_level.upper(), diagnose=False, backtrace=False)  # no local variables
    from .faults import Fault

    try:
        faults = [Fault.parse(text) for text in args.fault]
    except ValueError as exc:
        parser.error(str(exc))
    folders = {}
    for spec in args.model:
        name, _, folder = spec.rpartition("=")
        folder = os.path.expanduser(folder)
        name = name or os.path.basename(os.path.normpath(folder))
        if not os.path.isfile(os.path.join(folder, "config.json")):
            parser.error(f"--model {spec}: '{folder}' is not a model folder (no config.json)")
        folders[name] = folder

    import torch

    from .engine import BaseModel
    from .server import StandinServer

    torch.set_num_threads(args.threads)
    models = {name: BaseModel.from_folder(name, folder) for name, folder in folders.items()}
    server = StandinServer(models, state_dir=args.state_dir, host=args.host, port=args.port, api_key=args.api_key,
                           faults=faults, try_again_polls=args.try_again_polls, poll_wait_s=args.poll_wait,
                           fwdbwd_chunk_len=args.fwdbwd_chunk_len, sample_batch_rows=args.sample_batch_rows)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with server:
        print(f"Tinker stand-in serving {', '.join(models)} at {server.url} (state in {server.state_dir})",
              flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
