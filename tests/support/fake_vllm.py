"""A stand-in for the `vllm serve` executable: ``python fake_vllm.py MODEL --host H --port P ...``.

Takes `vllm serve`'s flags (the ones nexrl passes), serves :class:`FakeVLLMServer` until SIGTERM,
and logs to stdout as a server does. Its development routes are on only when
``VLLM_SERVER_DEV_MODE=1``, its API key comes from ``VLLM_API_KEY``, and the weight-transfer
routes only with ``--weight-transfer-config``, as in vLLM. Test-only flags shape its behaviour:

- ``--fake-record PATH``: write {argv, pid, child_pid, dev_mode, has_api_key} as JSON once serving;
- ``--fake-child``: start a child process (like vLLM's engine core) in the same process group;
- ``--fake-ready-after S``: ``/health`` answers 503 for the first S seconds;
- ``--fake-never-ready``: ``/health`` always answers 503;
- ``--fake-exit-after S`` / ``--fake-exit-code C``: exit with code C S seconds after starting;
- ``--fake-ignore-sigterm``: ignore SIGTERM (only SIGKILL stops it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests.support`

from tests.support.vllm_server import FakeVLLMServer  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm serve (fake)")
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--logprobs-mode", default="raw_logprobs")
    parser.add_argument("--served-model-name")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--weight-transfer-config")
    parser.add_argument("--fake-record")
    parser.add_argument("--fake-child", action="store_true")
    parser.add_argument("--fake-ready-after", type=float, default=0.0)
    parser.add_argument("--fake-never-ready", action="store_true")
    parser.add_argument("--fake-exit-after", type=float)
    parser.add_argument("--fake-exit-code", type=int, default=1)
    parser.add_argument("--fake-ignore-sigterm", action="store_true")
    args = parser.parse_args(argv)

    print(f"INFO fake vLLM: args {argv}", flush=True)
    if args.fake_exit_after is not None and args.fake_exit_after <= 0:
        print("ERROR fake vLLM: CUDA out of memory (simulated start-up failure)", flush=True)
        return args.fake_exit_code
    child = None
    if args.fake_child:  # an engine-core-like child in our process group
        child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
    transfer = None
    if args.weight_transfer_config:
        transfer = json.loads(args.weight_transfer_config).get("backend")
    server = FakeVLLMServer(model=args.served_model_name or args.model, host=args.host, port=args.port,
                            api_key=os.environ.get("VLLM_API_KEY") or None, dev_mode=dev_mode,
                            weight_transfer=transfer == "nccl")
    server.unhealthy = True
    server.start()
    if args.fake_record:
        Path(args.fake_record).write_text(json.dumps({
            "argv": argv, "pid": os.getpid(), "child_pid": child.pid if child else None, "dev_mode": dev_mode,
            "has_api_key": bool(os.environ.get("VLLM_API_KEY")), "logprobs_mode": args.logprobs_mode,
            "weight_transfer": transfer}))

    stop = threading.Event()

    def on_term(signum: int, _frame: object) -> None:
        print(f"INFO fake vLLM: got signal {signum}, shutting down", flush=True)
        stop.set()

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.fake_ignore_sigterm else on_term)
    signal.signal(signal.SIGINT, on_term)
    started = time.monotonic()
    print(f"INFO fake vLLM: serving {server.model} on {server.url}", flush=True)
    code = 0
    while not stop.wait(0.05):
        elapsed = time.monotonic() - started
        server.unhealthy = args.fake_never_ready or elapsed < args.fake_ready_after
        if args.fake_exit_after is not None and elapsed >= args.fake_exit_after:
            print("ERROR fake vLLM: engine core died (simulated)", flush=True)
            code = args.fake_exit_code
            break
    server.stop()
    if child is not None:
        child.terminate()
        child.wait(5)
    print("INFO fake vLLM: stopped", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
