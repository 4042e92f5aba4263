"""Weight-sync backends that push a self-hosted trainer's weights into a vLLM server.

- ``vllm_disk``: the trainer's tensors (``trainer.export_weights()``) are written as
  ``<sync_dir>/v<version>/model.safetensors`` (a folder the server can read), then the server
  reloads them (``/reload_weights``). Works with any vLLM on a shared filesystem; no GPU in the
  trainer process needed.
- ``vllm_lora``: only the trainer's LoRA adapter (``trainer.export_adapter()``, PEFT format) is
  written under ``<sync_dir>/v<version>/`` and loaded into a server started with LoRA on
  (``/v1/load_lora_adapter``) under a new name per version; requests then name that adapter.
- ``vllm_nccl``: vLLM's native weight-transfer API. Once: ``/get_world_size`` and
  ``/init_weight_transfer_engine`` while the trainer joins the NCCL group as rank 0. Per update:
  ``/start_weight_update``, ``/update_weights`` (the tensors' names, dtypes and shapes) while
  the trainer broadcasts them, ``/finish_weight_update``.

Both run inside :meth:`VLLMClient.weight_update`: generation held and paused around the
update, prefix cache reset, version set, generation resumed. Every phase has a timeout from the
``weight`` section; a failure raises :class:`SyncPhaseError` naming the version and the phase.
With ``weight.partial_rollout`` the requests the pause aborts keep their tokens and go on under
the new weights (see :mod:`nexrl_vllm.client`).

Options (``weight.<key>``; the controller passes the ``weight`` section):

====================  =========  ========================================================
``pause_mode``        abort      in-flight requests at the pause: ``abort`` (retried after the
                                 update, with the new version; with ``partial_rollout``:
                                 continued from their tokens), ``wait`` (finish first),
                                 ``keep`` (frozen, then finished with the new weights but
                                 labelled with the version they started under)
``control_timeout``   60         seconds for each control call (pause, resume, start, ...)
                                 and for in-flight requests to end after the pause
``transfer_timeout``  600        seconds for the weights to move (reload / broadcast + update)
``sync_dir``          null       vllm_disk, vllm_lora: folder shared with the server
                                 (default ``<run_dir>/weight_sync``)
``keep_versions``     1          vllm_disk, vllm_lora: weight folders kept (the newest ones)
``nccl_master_address`` null     vllm_nccl: address the server's workers reach the trainer at
                                 (default: this host's address towards the server)
``nccl_master_port``  null       vllm_nccl: rendezvous port (default: a free port)
``nccl_packed``       true       vllm_nccl: batch tensors into packed buffers
====================  =========  ========================================================
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from loguru import logger

from nexrl_core import Capabilities, ConfigError, Settings, WeightSyncBackend, setting

from .client import VLLMClient, _run_dir, require_vllm_client
from .control import PAUSE_MODES, SyncPhaseError, VLLMControl
from .server import WORKER_EXTENSION, free_port, is_loopback
from .transport import NcclTransport, TensorTransport

WEIGHTS_FILE = "model.safetensors"


def unique_tensors(state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``state``'s tensors in order, each storage once: a tied weight (``lm_head.weight`` sharing
    ``embed_tokens.weight``) keeps its first name, as HF checkpoints do and safetensors requires."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out.append((name, tensor.detach()))
    return out


@dataclass(frozen=True, kw_only=True)
class VLLMSyncSettings(Settings):
    """The ``weight`` keys of every vLLM weight sync."""

    pause_mode: str = setting("abort", "requests in flight at the pause: abort (retried with the new weights), "
                                       "wait (finish first) or keep (finished with the new weights)",
                              choices=PAUSE_MODES)
    control_timeout: float = setting(60.0, "seconds for each control call (pause, resume, reset, start, finish)",
                                     ge=0.001)
    transfer_timeout: float = setting(600.0, "seconds for the weights to move (reload, or broadcast and update)",
                                      ge=0.001)


@dataclass(frozen=True, kw_only=True)
class VLLMFolderSyncSettings(VLLMSyncSettings):
    """``vllm_disk`` and ``vllm_lora``: weights written to a folder the server reads."""

    sync_dir: str | None = setting(None, "folder the server can read, for the weight files (default: "
                                         "<run_dir>/weight_sync)")
    keep_versions: int = setting(1, "weight folders kept on disk", ge=1)


@dataclass(frozen=True, kw_only=True)
class VLLMNcclSyncSettings(VLLMSyncSettings):
    """``vllm_nccl``."""

    nccl_master_address: str | None = setting(None, "where vLLM's workers reach the trainer (default: this host's "
                                                    "address towards the server)")
    nccl_master_port: int | None = setting(None, "rendezvous port (default: a free one)", ge=1, le=65535)
    nccl_packed: bool = setting(True, "batch the tensors into packed buffers")


class _VLLMWeightSync(WeightSyncBackend):
    CAPABILITIES = Capabilities(
        provides=frozenset({"weight_sync:state_dict", "weight_sync:in_flight"}),
        requires={"trainer:state_dict": "it sends the tensors a trainer in this process exports",
                  "inference:vllm": "it loads them through a vLLM server's weight-update routes"})
    NAME = ""
    # Compatibility declaration: the transport this backend speaks (see VLLMClient.ACCEPTS_WEIGHT_TRANSPORTS).
    WEIGHT_TRANSPORT = "vllm"
    SETTINGS: type[VLLMSyncSettings] = VLLMSyncSettings

    @classmethod
    def check_config(cls, section: Mapping[str, Any] | None, key: str = "weight") -> list[str]:
        values = cls.own_section(section, key)
        settings, problems = cls.SETTINGS.parse(values, key, own=True)
        if settings is not None and values["partial_rollout"] is True and settings.pause_mode != "abort":
            problems.append(f"{key}.pause_mode: '{settings.pause_mode}' with {key}.partial_rollout: true: a partial "
                            "rollout aborts the requests in flight and continues them from their tokens; leave "
                            "pause_mode at abort")
        return problems

    def __init__(self, config: Mapping[str, Any] | None):
        super().__init__(config)  # self.config: the `weight` section, declared defaults filled
        self.settings = self.SETTINGS.own(self.config, "weight")
        problems = self.check_config(self.config, "weight")
        if problems:
            raise ConfigError("; ".join(problems))
        self.partial_rollout = self.config["partial_rollout"] is True
        self.pause_mode = self.settings.pause_mode
        self.control_timeout = self.settings.control_timeout
        self.transfer_timeout = self.settings.transfer_timeout
        self.last_timings: dict[str, float] = {}
        self.served_as = ""  # how the version is served, when not as the model itself (a LoRA adapter's name)

    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        client = require_vllm_client(inference_client, self.NAME)
        client.control.timeout = self.control_timeout
        started = time.perf_counter()
        try:
            staged = self._prepare(trainer, client, version)
            prepared = time.perf_counter()
            with client.weight_update(version, self.pause_mode, self.control_timeout,
                                      self.partial_rollout) as control:
                self._transfer(staged, control, version)
        except SyncPhaseError as exc:
            gone = client.server_exit(wait=3.0)  # the likely cause, said first
            raise SyncPhaseError(exc.phase, f"{gone + ': ' if gone else ''}vLLM weight sync to version {version} "
                                            f"failed in {exc}") from None
        done = time.perf_counter()
        self.last_timings = {"prepare_s": prepared - started, "update_s": done - prepared}
        logger.info(f"{self.NAME}: vLLM serves weight version {version}{self.served_as} (prepared in {prepared - started:.2f}s, "
                    f"generation held {done - prepared:.2f}s)")

    def _prepare(self, trainer: Any, client: VLLMClient, version: int) -> Any:
        """Work done while generation still runs; its result goes to :meth:`_transfer`."""
        raise NotImplementedError

    def _transfer(self, staged: Any, control: VLLMControl, version: int) -> None:
        """Move the weights in (generation is paused)."""
        raise NotImplementedError


class _VLLMFolderSync(_VLLMWeightSync):
    """Weights written as a folder the server can read, one per version under ``sync_dir``."""

    SETTINGS: type[VLLMFolderSyncSettings] = VLLMFolderSyncSettings
    settings: VLLMFolderSyncSettings

    def __init__(self, config: Mapping[str, Any] | None):
        super().__init__(config)
        sync_dir = self.settings.sync_dir
        if not sync_dir:  # null: next to the run's other files (the recipe's run_dir, read off its node)
            sync_dir = os.path.join(_run_dir(config, "..run_dir") or ".", "weight_sync")
        self.sync_dir = os.path.abspath(str(sync_dir))
        self.keep_versions = self.settings.keep_versions

    def _prepare(self, trainer: Any, client: VLLMClient, version: int) -> str:
        try:
            return self.write_folder(lambda folder: self._fill(trainer, folder, version), version)
        except OSError as exc:
            raise SyncPhaseError("write_safetensors", f"phase 'write_safetensors': cannot write the weights under "
                                                      f"{self.sync_dir} ({exc})") from None

    def _fill(self, trainer: Any, folder: str, version: int) -> None:
        """Write version ``version``'s files into the new folder ``folder``."""
        raise NotImplementedError

    def write_folder(self, fill: Callable[[str], None], version: int) -> str:
        """``<sync_dir>/v<version>/``, filled aside and renamed into place."""
        os.makedirs(self.sync_dir, exist_ok=True)
        final = os.path.join(self.sync_dir, f"v{version:06d}")
        tmp = tempfile.mkdtemp(prefix=f".v{version:06d}.", dir=self.sync_dir)
        try:
            fill(tmp)
            os.chmod(tmp, 0o755)  # the server may run as another user
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _prune(self, version: int) -> None:
        names = sorted(n for n in os.listdir(self.sync_dir) if n.startswith("v") and n[1:].isdigit())
        for name in names[:-self.keep_versions]:
            shutil.rmtree(os.path.join(self.sync_dir, name), ignore_errors=True)


class VLLMDiskWeightSync(_VLLMFolderSync):
    """``vllm_disk``: safetensors on a shared folder, reloaded by the server."""

    NAME = "vllm_disk"
    _said_no_extension = False

    def _fill(self, trainer: Any, folder: str, version: int) -> None:
        write_weights(trainer.export_weights(), folder, version)

    def write(self, state: Mapping[str, Any], version: int) -> str:
        """``<sync_dir>/v<version>/model.safetensors`` holding ``state``."""
        return self.write_folder(lambda folder: write_weights(state, folder, version), version)

    def _transfer(self, staged: str, control: VLLMControl, version: int) -> None:
        control.reload_weights(staged, timeout=self.transfer_timeout)
        if control.refresh_tied_output() is None and not self._said_no_extension:
            self._said_no_extension = True
            logger.info("vllm_disk: the server runs without nexrl's worker extension (--worker-extension-cls "
                        f"{WORKER_EXTENSION}); a vLLM CPU server then keeps an output layer tied to the embedding "
                        "as it was before the reload (weight/served_probe_gap shows it)")
        self._prune(version)


def write_weights(state: Mapping[str, Any], folder: str, version: int) -> None:
    from safetensors.torch import save_file

    tensors = {name: t.cpu().contiguous() for name, t in unique_tensors(state)}
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt", "nexrl_version": str(version)})


class VLLMLoraWeightSync(_VLLMFolderSync):
    """``vllm_lora``: only the LoRA adapter travels. Each push writes the adapter (PEFT format) and
    loads it into the server under a new name, ``<served model>-lora-v<version>``; requests from then
    on name that adapter. The adapter before it stays loaded one more push (requests kept across a
    ``pause_mode: keep`` update still use it), older ones are unloaded."""

    NAME = "vllm_lora"
    CAPABILITIES = Capabilities(
        provides=frozenset({"weight_sync:state_dict", "weight_sync:in_flight"}),
        requires={"trainer:state_dict": "it sends the adapter a trainer in this process exports",
                  "inference:vllm": "it loads the adapter through a vLLM server's LoRA routes"})

    def __init__(self, config: Mapping[str, Any] | None):
        super().__init__(config)
        self._client: VLLMClient | None = None
        self._base_model: str | None = None
        self._loaded: list[str] = []

    def _fill(self, trainer: Any, folder: str, version: int) -> None:
        try:
            trainer.export_adapter(folder)
        except NotImplementedError as exc:
            raise SyncPhaseError("export_adapter", f"phase 'export_adapter': weight.backend vllm_lora sends a LoRA "
                                                   f"adapter, and the trainer has none ({exc}): set "
                                                   "service.train_service.lora, or use weight.backend vllm_disk") from None

    def _prepare(self, trainer: Any, client: VLLMClient, version: int) -> str:
        self._client = client
        if self._base_model is None:
            self._base_model = client._served_model()
        return super()._prepare(trainer, client, version)

    def _transfer(self, staged: str, control: VLLMControl, version: int) -> None:
        assert self._client is not None
        name = f"{self._base_model}-lora-v{version}"
        try:
            control.load_lora_adapter(name, staged, timeout=self.transfer_timeout)
        except SyncPhaseError as exc:
            hint = ("" if self._client.lora_enabled else
                    "; the server must serve LoRA adapters: service.inference_service.enable_lora: true (a server "
                    "nexrl starts), or start yours with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
            raise SyncPhaseError(exc.phase, f"{exc}{hint}") from None
        self._client.model = name  # requests from now on are served by the new adapter
        self._client.lora_enabled = True  # an attached server serves adapters too: score one prompt per call
        self.served_as = f" as LoRA adapter '{name}'"
        self._loaded.append(name)
        while len(self._loaded) > 2:
            control.unload_lora_adapter(self._loaded.pop(0))
        self._prune(version)


class VLLMNcclWeightSync(_VLLMWeightSync):
    """``vllm_nccl``: vLLM's weight-transfer engine, tensors broadcast over NCCL from the trainer."""

    NAME = "vllm_nccl"
    SETTINGS: type[VLLMNcclSyncSettings] = VLLMNcclSyncSettings
    settings: VLLMNcclSyncSettings
    # The tensor path (a GPU piece); tests put a CPU stand-in here to drive the HTTP phases.
    # Called with the device of the trainer's tensors (None when they live on the host).
    transport_factory: Callable[[Any], TensorTransport] = NcclTransport

    def __init__(self, config: Mapping[str, Any] | None):
        super().__init__(config)
        self.master_address = self.settings.nccl_master_address
        self.master_port = self.settings.nccl_master_port
        self.packed = self.settings.nccl_packed
        self.transport: TensorTransport | None = None
        self._init_lock = threading.Lock()

    def _prepare(self, trainer: Any, client: VLLMClient, version: int) -> list[tuple[str, Any]]:
        tensors = unique_tensors(trainer.export_weights())
        with self._init_lock:
            if self.transport is None:
                device = next((t.device for _, t in tensors if getattr(t, "is_cuda", False)), None)
                self._init_transfer(client, device)
        return tensors

    def _init_transfer(self, client: VLLMClient, device: Any) -> None:
        control = client.control
        world = control.world_size() + 1  # the server's workers and this trainer
        host = urlparse(client.root_url).hostname or "127.0.0.1"
        address = str(self.master_address or ("127.0.0.1" if is_loopback(host) else _address_towards(host)))
        port = int(self.master_port or free_port(address))
        transport = type(self).transport_factory(device)  # the trainer's GPU, where its tensors already are
        init_info = {"master_address": address, "master_port": port, "rank_offset": 1, "world_size": world}
        # The server's workers connect to the trainer's rendezvous: both sides must run at once.
        _together("init_weight_transfer_engine", self.transfer_timeout,
                  server=lambda: control.init_weight_transfer(init_info, timeout=self.transfer_timeout + 5.0),
                  trainer=lambda: transport.init(address, port, world))
        self.transport = transport
        logger.info(f"vllm_nccl: weight-transfer group ready ({world} ranks, rendezvous {address}:{port})")

    def _transfer(self, staged: list[tuple[str, Any]], control: VLLMControl, version: int) -> None:
        transport = self.transport
        assert transport is not None
        update_info = {"names": [n for n, _ in staged],
                       "dtype_names": [str(t.dtype).rsplit(".", 1)[-1] for _, t in staged],
                       "shapes": [list(t.shape) for _, t in staged],
                       "packed": self.packed}
        control.start_weight_update()
        # The HTTP call may wait a little longer than the phase: when the broadcast stalls, the
        # error then names the transport (the cause), not the server's silence (the symptom).
        _together("update_weights", self.transfer_timeout,
                  server=lambda: control.update_weights(update_info, timeout=self.transfer_timeout + 5.0),
                  trainer=lambda: transport.send(staged, self.packed))
        control.finish_weight_update(version)


def _address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (what the server's workers can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))  # UDP: no packet is sent
            return str(sock.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _together(phase: str, timeout: float, server: Callable[[], None], trainer: Callable[[], None]) -> None:
    """Run the server's HTTP call and the trainer's side at once; both must finish within ``timeout``.

    A side that hangs (a broadcast nobody receives) is left behind in its daemon thread: the
    sync fails with the phase named instead of hanging the run."""
    errors: dict[str, BaseException] = {}

    def run(side: str, fn: Callable[[], None]) -> threading.Thread:
        def target() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors[side] = exc
        thread = threading.Thread(target=target, name=f"vllm-sync-{phase}-{side}", daemon=True)
        thread.start()
        return thread

    threads = {"server": run("server", server), "trainer": run("trainer", trainer)}
    deadline = time.monotonic() + timeout
    for side, thread in threads.items():
        thread.join(max(0.0, deadline - time.monotonic()))
        if side in errors:
            break  # the other side may never finish now
    failed = errors.get("server") or errors.get("trainer")
    if isinstance(failed, SyncPhaseError):
        raise failed
    if failed is not None:
        side = "server" if "server" in errors else "trainer"
        raise SyncPhaseError(phase, f"phase '{phase}': the {side} side failed ({type(failed).__name__}: {failed})")
    pending = [side for side, thread in threads.items() if thread.is_alive()]
    if pending:
        what = {"server": "the server did not confirm", "trainer": "the trainer's tensor transport did not finish"}
        raise SyncPhaseError(phase, f"phase '{phase}': {' and '.join(what[s] for s in pending)} within "
                                    f"{timeout:g}s (weight.transfer_timeout)")
