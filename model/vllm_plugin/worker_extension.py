"""What `VllmEngine` runs inside vLLM's workers, as methods of vLLM's worker class.

vLLM mixes the class named by the engine argument ``worker_extension_cls`` into its worker class, so
`LLM.collective_rpc("odyssey_take_routing", ...)` calls a method by name in every worker process. Calling by
name (not by passing a function) keeps a multi-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, tensor
parallel) on vLLM's msgpack RPC: a function would need ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickle).
Return values cross that RPC too, so the routing rows travel as pickled bytes (numpy arrays do not survive
it intact), and new weights go through a file (the RPC cannot carry a list of tensors). The in-process
engine calls the same methods, and passes new weights as tensors.
"""

from __future__ import annotations

import pickle

import torch

from model.vllm_plugin import routing

WORKER_EXTENSION = "model.vllm_plugin.worker_extension.OdysseyWorkerExtension"


class OdysseyWorkerExtension:
    """Mixed into vLLM's worker (`self` is the worker: `self.model_runner`)."""

    def odyssey_install_routing(self) -> bool:
        """Record every step's routed experts by request (model/vllm_plugin/routing.py)."""
        return routing.install(self)

    def odyssey_take_routing(self, req_ids: list[str]) -> bytes:
        """Remove the routing rows of `req_ids` from the log: pickled {req_id: (positions, experts)}."""
        return pickle.dumps(routing.take(self, req_ids))

    def odyssey_timing(self) -> dict[str, float]:
        """The model's cumulative timing counters (forward_s, execute_model_s, forwards)."""
        return routing.timing(self)

    def odyssey_reload_weights_file(self, path: str | list[str]) -> None:
        """`reload_weights` from a state dict that `VllmEngine.update_weights` saved with torch.save (a
        multi-process engine: tensors do not cross vLLM's RPC), or from the bucket files of
        `update_weights_stream`, read one at a time as the reload consumes them."""
        if isinstance(path, str):
            state = torch.load(path, map_location="cpu", weights_only=True)
            self.reload_weights(weights_iterator=list(state.items()), is_checkpoint_format=True)
            return

        def pairs():
            for p in path:
                yield from torch.load(p, map_location="cpu", weights_only=True).items()

        self.reload_weights(weights_iterator=pairs(), is_checkpoint_format=True)

    def odyssey_checkpoint_names(self) -> list[str]:
        """The tensor names the loaded model takes from a checkpoint."""
        from model.vllm_plugin.modeling import checkpoint_names

        return sorted(checkpoint_names(self.model_runner.get_model()))
