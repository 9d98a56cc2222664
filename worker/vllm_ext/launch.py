"""vLLM's engine core started for several frontends, as ``vllm serve --api-server-count N``
starts it: one engine core process (with its GPU worker) and N ``AsyncLLM`` clients, each in a
process of its own, each binding its own pair of ZMQ sockets, which the engine core connects to
and answers each request on (``client_index``).

``AsyncLLM(client_addresses=, client_count=, client_index=)`` is public in vLLM 0.26 through
0.33; starting the engine core for clients it does not manage is not: ``launch_core_engines``
takes ``num_api_servers`` and yields a tuple in 0.26, and takes no count and yields a
``CoreEngineLaunch`` in 0.32. ``launch`` is verified on those two (``VERIFIED``) and refuses,
with ``ConfigError``, every other version, which keeps the one-frontend path.
"""

from __future__ import annotations

import contextlib
import glob
import inspect
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from .compat import release, vllm_version
from .configure import ConfigError

log = logging.getLogger(__name__)

VERIFIED = ("0.26", "0.32")
# ``Settings.frontend`` of an intake process that is one of the engine core's clients:
# ``vllm-clients:<socket path prefix>:<clients>:<this one's index>``
CLIENTS = "vllm-clients:"


def client_addresses(base: str, index: int) -> dict[str, str]:
    """Client ``index``'s two sockets: requests in (the engine core reads them), outputs out."""
    return {
        "input_address": f"ipc://{base}-in{index}",
        "output_address": f"ipc://{base}-out{index}",
    }


def new_base() -> str:
    """A fresh path prefix for one engine's client sockets, in the temporary directory."""
    return os.path.join(tempfile.gettempdir(), f"vqueue-engine-{os.getpid()}-{os.urandom(4).hex()}")


def remove_sockets(base: str) -> None:
    for path in glob.glob(f"{glob.escape(base)}-*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def check_version() -> None:
    version = release(vllm_version())
    if version not in VERIFIED:
        raise ConfigError(
            f"VQUEUE_ENGINE_CLIENTS needs vLLM {' or '.join(VERIFIED)} (starting an engine core "
            f"for several AsyncLLM clients is vLLM-internal); this is {version}"
        )


@dataclass
class CoreLaunch:
    """The engine core process(es) this process started for ``clients`` frontends."""

    manager: Any  # vLLM's CoreEngineProcManager
    clients: int

    def sentinels(self) -> list[Any]:
        return list(self.manager.sentinels())

    def shutdown(self) -> None:
        self.manager.shutdown()


def launch(config: Any, clients: int, base: str, log_stats: bool = True) -> CoreLaunch:
    """Start the engine core for ``clients`` AsyncLLM clients at ``client_addresses(base, i)``
    and wait until it has loaded the model (vLLM's startup handshake). The clients may bind
    their sockets before or after: the engine core connects and ZMQ delivers once both are up."""
    check_version()
    from vllm.v1.engine.utils import EngineZmqAddresses, launch_core_engines
    from vllm.v1.executor import Executor

    config.parallel_config._api_process_count = clients
    each = [client_addresses(base, i) for i in range(clients)]
    addresses = EngineZmqAddresses(
        inputs=[a["input_address"] for a in each], outputs=[a["output_address"] for a in each]
    )
    kwargs: dict[str, Any] = {}
    if "num_api_servers" in inspect.signature(launch_core_engines).parameters:  # 0.26
        kwargs["num_api_servers"] = clients
    started = launch_core_engines(
        config, Executor.get_class(config), log_stats, addresses, **kwargs
    )
    got = started.__enter__()
    manager = got[0] if isinstance(got, tuple) else got.engine_manager
    try:
        started.__exit__(None, None, None)  # vLLM's startup handshake: the model is loaded
    except BaseException:
        if manager is not None:
            manager.shutdown()
        raise
    if manager is None:
        raise RuntimeError("vLLM started no local engine core")
    log.info("engine core started for %d frontends", clients)
    return CoreLaunch(manager, clients)
